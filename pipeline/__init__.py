"""A declarative, cached LLM post-training pipeline on Ray.

`python -m pipeline run configs/full.yaml` runs every stage the YAML describes; see README.md.
Importing this package stays light (no ray, torch, vllm, deepspeed, mlflow): heavy imports live
inside the functions that need them, so `validate` and `plan` answer in well under a second.
"""

__version__ = "0.1.0"
