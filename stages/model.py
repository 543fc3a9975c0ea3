"""Model stage: the base model and tokenizer every later stage starts from.

With `model.source: builtin` (the embedded default) it trains a byte-level BPE tokenizer on the
task corpus and builds a tiny random LLaMA (see `stages.common.models`), saved in HF format.
With `model.source: /path/to/checkpoint` it checks that the directory loads (config, tokenizer
with a chat template) and passes the path on without copying; the directory's contents are part
of the cache key, so replacing the checkpoint reruns everything downstream. With a GGUF file
(`path/to/model.gguf`, or `package:<module>/<file>.gguf` inside an installed package) it
dequantises it once into a safetensors HF directory, keyed by the file's content.

Run alone: `python -m pipeline run configs/full.yaml --only model`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from stages.common.models import ModelConfig

if TYPE_CHECKING:  # annotations only: a stage's key covers the code it runs, not its types
    from pipeline.stage import StageContext


def raw_inputs(pcfg) -> list[Path]:
    """Files whose contents are part of this stage's cache key: a user checkpoint's files."""
    return [] if pcfg.model.is_builtin else [pcfg.model.path]


def run(cfg: ModelConfig, ctx: StageContext) -> dict[str, Path]:
    """`cfg` is the top-level `model` section."""
    from stages.common import models, tasks

    if cfg.is_gguf:
        ctx.progress(f"dequantising {cfg.path.name} into an HF checkpoint")
        out = models.convert_gguf(cfg.path, ctx.out_dir / "model")
        return {"base_model": _checked(out, ctx)}
    if not cfg.is_builtin:
        from transformers import AutoConfig

        AutoConfig.from_pretrained(cfg.source, local_files_only=True, trust_remote_code=False)
        tok = models.load_tokenizer(cfg.source)
        ctx.log_metrics({"vocab_size": len(tok)})
        return {"base_model": Path(cfg.source)}

    ctx.progress("training the byte-level BPE tokenizer on the task corpus")
    corpus = tasks.corpus(ctx.pipeline.task, ctx.pipeline.seed)
    out = models.build_base_model(ctx.out_dir / "model", cfg.builtin, corpus, ctx.pipeline.seed)
    tok = models.load_tokenizer(out)
    from transformers import AutoModelForCausalLM

    n_params = models.count_parameters(AutoModelForCausalLM.from_pretrained(out, **models.SAFE_LOAD))
    ctx.progress(f"built a {n_params / 1e6:.2f}M-parameter LLaMA with a {len(tok)}-token vocabulary")
    ctx.log_metrics({"num_parameters": n_params, "vocab_size": len(tok)})
    return {"base_model": out}


def _checked(out: Path, ctx: StageContext) -> Path:
    """Load what was written, as every later stage will, and report its size."""
    from transformers import AutoModelForCausalLM

    from stages.common import models

    tok = models.load_tokenizer(out)
    model = AutoModelForCausalLM.from_pretrained(out, **models.SAFE_LOAD)
    n_params = models.count_parameters(model)
    ctx.progress(f"a {n_params / 1e6:.1f}M-parameter {type(model).__name__} with a {len(tok)}-token vocabulary")
    ctx.log_metrics({"num_parameters": n_params, "vocab_size": len(tok)})
    return out
