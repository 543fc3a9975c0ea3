"""vLLM engine settings shared by online serving (Ray Serve LLM) and batch inference (Ray Data LLM).

Both build the same vLLM engine from the same YAML section (`EngineConfig`), so a model answers a
batch job exactly as it answers the API. The CPU/GPU split lives here and nowhere else: on a CPU
machine vLLM reserves `kv_cache_gb` of RAM for its KV cache (`VLLM_CPU_KVCACHE_SPACE`) and its
`gpu_memory_utilization` is a fraction of *CPU* memory, so it must be small (docs/architecture.md, fact 3);
on a GPU the usual 0.9 applies and graphs are captured (no `enforce_eager`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import Field, field_validator

from pipeline.schema import Section, key_errors

# Engine arguments the project decides and `extra` may not reopen: model code from the checkpoint, and the weights'
# format (pickle weights can run code when loaded).
PINNED = {"trust_remote_code": "set engine.trust_remote_code instead (off by default: only architectures built "
                               "into vLLM and transformers load)",
          "load_format": "the engine always loads safetensors: pickle weights can run code when loaded"}


class EngineConfig(Section):
    """The vLLM engine behind the API and batch inference."""

    max_model_len: int | None = Field(None, ge=16, description="Longest prompt + completion in tokens. Empty: the "
                                      "model's max_position_embeddings.")
    dtype: str = Field("auto", pattern="^(auto|float32|bfloat16|float16)$",
                       description="Weights/activations dtype: auto (the checkpoint's), float32, bfloat16 or float16.")
    max_num_seqs: int = Field(32, ge=1, description="Sequences an engine batches at once (concurrent requests it "
                                                    "decodes together).")
    kv_cache_gb: float = Field(1.0, gt=0,
                               description="CPU only: GiB of RAM reserved for the KV cache (VLLM_CPU_KVCACHE_SPACE).")
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1, description="Fraction of device memory vLLM may "
                                                 "use. Empty: 0.3 on CPU (it is a fraction of RAM there), 0.9 on GPU.")
    trust_remote_code: bool = Field(False, description="Run model code shipped inside the checkpoint. Off: only "
                                    "architectures built into vLLM/transformers load.")
    extra: dict[str, Any] = Field(default_factory=dict, description="Further vLLM engine arguments passed as they "
                                  "are (e.g. {enable_prefix_caching: true}); not trust_remote_code (its own key) or "
                                  "load_format (always safetensors).")

    @field_validator("extra")
    @classmethod
    def _pinned_keys_stay_pinned(cls, extra: dict[str, Any]) -> dict[str, Any]:
        problems = pinned_keys(extra)
        if problems:
            raise key_errors("EngineConfig", problems)  # each at its path: stages.serve.engine.extra.load_format
        return extra


def pinned_keys(extra: dict[str, Any]) -> list[tuple[str, Any, str]]:
    """(key, value, why) for each key of a raw engine-argument mapping that would reopen what the project pins
    (PINNED), however it is spelled (`trust-remote-code`, `Load_Format`)."""
    return [(key, value, f"not allowed in extra: {PINNED[norm]}; remove it") for key, value in extra.items()
            if (norm := str(key).strip().lower().replace("-", "_")) in PINNED]


def model_max_len(model_dir: Path) -> int:
    """The longest sequence a checkpoint supports (config.json's max_position_embeddings)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return int(config.get("max_position_embeddings") or config.get("n_positions") or 2048)


def context_length(cfg: EngineConfig, model_dir: Path) -> int:
    """The engine's max_model_len: the configured one, checked against what the model supports."""
    from pipeline.errors import UserError

    limit = model_max_len(model_dir)
    if cfg.max_model_len is not None and cfg.max_model_len > limit:
        raise UserError(f"engine.max_model_len: {cfg.max_model_len} exceeds the model's max_position_embeddings "
                        f"({limit}, {model_dir}); lower it or leave it empty")
    return cfg.max_model_len or limit


def engine_kwargs(cfg: EngineConfig, model_dir: Path, gpu: bool, seed: int = 0) -> dict[str, Any]:
    """Keyword arguments of vLLM's engine (`LLM(...)`, `LLMConfig.engine_kwargs`) for this config."""
    return {
        "dtype": cfg.dtype, "max_model_len": context_length(cfg, model_dir), "max_num_seqs": cfg.max_num_seqs,
        "gpu_memory_utilization": cfg.gpu_memory_utilization or (0.9 if gpu else 0.3),
        "enforce_eager": not gpu, "seed": seed, **cfg.extra,
        # last, so that `extra` cannot change them (it is refused at validation too: PINNED): model code from the
        # checkpoint only when its own key says so, and never pickle weights (they can run code when loaded)
        "trust_remote_code": cfg.trust_remote_code, "load_format": "safetensors",
    }


def engine_env(cfg: EngineConfig, gpu: bool) -> dict[str, str]:
    """Environment variables vLLM reads at start-up (they must be in the engine process's environment)."""
    env = {"TOKENIZERS_PARALLELISM": "false"}
    if not gpu:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, round(cfg.kv_cache_gb)))
    return env


# The models a pipeline may serve or run batch inference with, and the stage that makes each (the model
# stage, always there, makes base_model).
MODEL_MAKERS = {"sft_model": "sft", "policy_model": "ppo", "dpo_model": "dpo"}


def check_source(key: str, source: str | None, stages_cfg: Any) -> None:
    """`key` (a serve or batch-infer source) names a model this pipeline makes."""
    made = {"base_model", *(m for m, stage in MODEL_MAKERS.items() if getattr(stages_cfg, stage) is not None)}
    if source and source not in made:
        raise ValueError(f"{key} is {source} but stages.{MODEL_MAKERS[source]} is null; use one of "
                         f"{', '.join(sorted(made))}")
