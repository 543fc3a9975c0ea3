"""DeepSpeed and device settings shared by the training stages.

`TrainingConfig` holds the typed YAML fields (ZeRO stage, offload, batch sizes, learning-rate
schedule, precision, ...); `deepspeed_config` turns them into the DeepSpeed config dict, with a
user's raw `deepspeed.extra` dict merged over it last. Mistakes that DeepSpeed would only report
inside a worker minutes later (a batch size that does not divide, parameter offload without
ZeRO-3) are rejected here, at validation, with the key named.

What a process computes on is decided in that process (stages/common/devices.py); here only what follows
from the driver's choice to ask Ray for GPUs (`backend`: NCCL for a Ray Train group whose workers each hold
one, `for_device`: an optimizer that needs no compiler). The code is the same on both.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from pipeline.schema import Section, key_errors


class DeepSpeedSection(Section):
    """DeepSpeed ZeRO settings."""

    zero_stage: Literal[0, 1, 2, 3] = Field(2, description="ZeRO stage: 0 off, 1 optimizer states, 2 + gradients, "
                                                        "3 + parameters sharded.")
    offload_optimizer: bool = Field(False, description="Keep optimizer states in CPU memory (ZeRO >= 1). "
                                                       "Only matters with a GPU.")
    offload_params: bool = Field(False, description="Keep parameters in CPU memory (ZeRO-3 only). "
                                                    "Only matters with a GPU.")
    precision: Literal["auto", "bf16", "fp32"] = Field("auto", description="'auto': bf16 on GPUs (since Ampere: A100, "
                                                       "H100, L4; set fp32 on a V100 or T4), fp32 on the CPU.")
    activation_checkpointing: bool = Field(False, description="Recompute activations in backward to save memory.")
    extra: dict[str, Any] = Field({}, description="Raw DeepSpeed config merged over the generated one (last word).")

    @field_validator("extra")
    @classmethod
    def _checkpoint_loads_stay_safe(cls, extra: dict[str, Any]) -> dict[str, Any]:
        problems = unsafe_checkpoint_keys(extra)
        if problems:  # each at its own path: stages.sft.deepspeed.extra.checkpoint.load_universal
            raise key_errors("DeepSpeedSection", problems)
        return extra

    @model_validator(mode="after")
    def _offload_needs_zero(self) -> "DeepSpeedSection":
        if self.offload_params and self.zero_stage != 3:
            raise ValueError(f"offload_params needs zero_stage 3 (got {self.zero_stage}); set zero_stage: 3 "
                             "or offload_params: false")
        if self.offload_optimizer and self.zero_stage == 0:
            raise ValueError("offload_optimizer needs zero_stage >= 1; set zero_stage: 1, 2 or 3")
        return self


def unsafe_checkpoint_keys(extra: dict[str, Any]) -> list[tuple[str, Any, str]]:
    """(dotted key, value, why) for each setting of a raw DeepSpeed dict whose checkpoint loads would
    escape `weights_only_loads` (every other checkpoint engine, e.g. `checkpoint.writer`'s fast and
    decoupled ones, loads through it)."""
    problems = []
    checkpoint = extra.get("checkpoint")
    if isinstance(checkpoint, dict) and checkpoint.get("load_universal"):
        problems.append(("checkpoint.load_universal", checkpoint["load_universal"], (
            "not supported: the stages resume only from the ZeRO checkpoints they write themselves, never from a "
            "universal checkpoint (made offline by DeepSpeed's ds_to_universal, whose files the allow-list of what "
            "a resume may unpickle was not built for); remove it")))
    if "datastates_ckpt" in extra and extra["datastates_ckpt"] is not False:  # DeepSpeed: present and not False = on
        problems.append(("datastates_ckpt", extra["datastates_ckpt"], (
            "not supported: the DataStates checkpoint engine loads with its own library, outside the allow-listed "
            "weights_only load every resume goes through (a checkpoint can run code when unpickled); remove it")))
    if "nebula" in extra:
        problems.append(("nebula", extra["nebula"], "not supported: DeepSpeed 0.19 removed Nebula checkpointing "
                         "(it refuses the key when the engine starts); remove it"))
    for key, value in extra.items():  # what the project pins for every model load (as engine.extra refuses them)
        if str(key).strip().lower().replace("-", "_") in ("trust_remote_code", "load_format"):
            problems.append((str(key), value, "not allowed in extra: models load from safetensors only and never "
                             "run code shipped in a checkpoint; remove it"))
    return problems


class LoraSection(Section):
    """Train LoRA adapters instead of every weight (PEFT; the code is stages/common/lora.py)."""

    r: int = Field(16, ge=1, description="Rank of each adapter's low-rank update.")
    alpha: float = Field(32.0, gt=0, description="Scale of the update (the update is multiplied by alpha / r).")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapter's input during training.")
    target_modules: list[str] | Literal["all-linear"] = Field(
        "all-linear", description="Layers that get an adapter: 'all-linear' (every linear layer but the output "
        "layer) or a list of module names, e.g. [q_proj, v_proj].")

    @field_validator("target_modules")
    @classmethod
    def _some_targets(cls, v):
        if isinstance(v, list) and not v:
            raise ValueError("an empty list adapts nothing; use 'all-linear' or name modules, e.g. [q_proj, v_proj]")
        return v


def describe(lora: LoraSection | None) -> str:
    """How a progress line names a role's LoRA ('' for full fine-tuning)."""
    if lora is None:
        return ""
    targets = lora.target_modules if isinstance(lora.target_modules, str) else ",".join(lora.target_modules)
    return f", LoRA r={lora.r} on {targets}"


def zero3_problem(lora: LoraSection | None, zero_stage: int, where: str) -> str | None:
    """Why a role's LoRA and DeepSpeed settings cannot go together (None if they can)."""
    if lora is not None and zero_stage == 3:
        return (f"{where}: LoRA with deepspeed.zero_stage 3 is not supported (merging the adapter reads whole "
                "weights); use zero_stage 2, which with a frozen base already shards all that grows")
    return None


class TrainingConfig(Section):
    """Optimisation settings shared in shape by the sft and reward stages."""

    num_workers: int = Field(2, ge=1, description="Ray Train workers (data-parallel ranks); 1 trains in the "
                             "pipeline's own process, no worker group (docs/training.md).")
    epochs: int = Field(1, ge=1, description="Passes over the training split.")
    max_steps: int | None = Field(None, ge=1,
                                  description="Stop after this many optimizer steps (empty: run all epochs).")
    batch_size: int = Field(32, ge=1, description="Global batch: sequences per optimizer step over all workers.")
    micro_batch_size: int = Field(8, ge=1, description="Sequences per worker per forward pass; the rest is "
                                                       "gradient accumulation.")
    lr: float = Field(1e-3, gt=0, description="Peak learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    warmup_steps: int = Field(10, ge=0, description="Linear warm-up steps from 0 to lr.")
    lr_schedule: Literal["cosine", "linear", "constant"] = Field("cosine", description="Decay after warm-up.")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="Final lr as a fraction of the peak (cosine/linear).")
    grad_clip: float = Field(1.0, gt=0, description="Gradient norm clipping.")
    eval_every: int = Field(50, ge=1, description="Evaluate on the eval split every N optimizer steps.")
    checkpoint_every: int = Field(100, ge=1,
                                  description="Report a checkpoint every N optimizer steps (and at the end).")
    keep_checkpoints: int = Field(2, ge=1, description="Checkpoints kept by Ray Train (CheckpointConfig.num_to_keep).")
    max_failures: int = Field(1, ge=0, description="Worker failures Ray Train recovers from (restarting from the "
                                                   "last checkpoint).")
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK", description="How Ray places the workers on a cluster's nodes (Ray Train's ScalingConfig): 'PACK' "
        "fills few nodes (fast collectives), 'SPREAD' / 'STRICT_SPREAD' put them on different nodes.")
    deepspeed: DeepSpeedSection = Field(default_factory=DeepSpeedSection, description="DeepSpeed ZeRO settings.")
    lora: LoraSection | None = Field(None, description="Train LoRA adapters instead of every weight (empty: full "
                                     "fine-tuning); the adapter is merged into the model when the stage ends.")
    use_tuned: bool = Field(False, description="Train with the best values of the tune stage's sweep over this stage "
                            "(needs stages.tune with this stage as target).")

    @model_validator(mode="after")
    def _batch_divides(self) -> "TrainingConfig":
        per_step = self.micro_batch_size * self.num_workers
        if self.batch_size % per_step:
            raise ValueError(
                f"batch_size ({self.batch_size}) must be a multiple of micro_batch_size x num_workers "
                f"({self.micro_batch_size} x {self.num_workers} = {per_step}); "
                f"e.g. batch_size: {per_step * max(1, self.batch_size // per_step)}"
            )
        return self

    @model_validator(mode="after")
    def _lora_fits_zero(self) -> "TrainingConfig":
        problem = zero3_problem(self.lora, self.deepspeed.zero_stage, "lora")
        if problem:
            raise ValueError(problem)
        return self

    @property
    def grad_accum(self) -> int:
        return self.batch_size // (self.micro_batch_size * self.num_workers)


def needs_sft(name: str, pipeline_cfg: Any) -> None:
    """`stages.<name>.init_from: sft` (the reward and dpo stages' `check`): there must be an sft stage."""
    section = getattr(pipeline_cfg.stages, name)
    if section is not None and pipeline_cfg.stages.sft is None and section.init_from == "sft":
        raise ValueError(f"stages.{name}.init_from is sft but stages.sft is null; set stages.{name}.init_from: base")


def train_check(name: str, pipeline_cfg: Any, from_sft: bool = True) -> None:
    """A Train stage's `check` hook: with `from_sft` (reward, dpo), `init_from: sft` needs an sft stage; on a local
    Ray with GPUs, one for each worker (`devices.check_local_workers`)."""
    from stages.common.devices import check_local_workers

    if from_sft:
        needs_sft(name, pipeline_cfg)
    check_local_workers(pipeline_cfg, name)


def without_sft(spec: Any, pipeline_cfg: Any, stages: tuple) -> tuple:
    """The reward and dpo stages' `wire`: without an sft stage they start from the base model alone."""
    if pipeline_cfg.stages.sft is None:
        spec = replace(spec, inputs=tuple(i for i in spec.inputs if i != "sft_model"))
    return (*stages, spec)


def total_steps(n_rows: int, cfg: TrainingConfig) -> int:
    """Optimizer steps of a run: full micro-batches per worker, accumulated, over all epochs."""
    micro_per_epoch = (n_rows // cfg.num_workers) // cfg.micro_batch_size
    steps = cfg.epochs * micro_per_epoch // cfg.grad_accum
    return min(steps, cfg.max_steps) if cfg.max_steps else steps


def use_bf16(ds: DeepSpeedSection, gpu: bool) -> bool:
    """'bf16', or 'auto' on hardware that supports it."""
    return ds.precision == "bf16" or (ds.precision == "auto" and bf16_supported(gpu))


def backend(gpu: bool) -> str:
    return "nccl" if gpu else "gloo"


def bf16_supported(gpu: bool) -> bool:
    """Whether 'auto' precision is bf16. On GPUs (`gpu`: the stage asks Ray for them) it is: the driver does not
    compute on them, so it cannot ask them, and every data-centre GPU since Ampere (A100, H100, L4, A10) has bf16;
    on an older one (V100, T4) set precision: fp32. On the CPU it is not: the CPU path computes in fp32, as its
    tests, benches and recorded outcomes were measured (so 'auto', the default, leaves it unchanged)."""
    return gpu


def merge(base: dict, extra: dict) -> dict:
    """Deep-merge `extra` over `base` (the user's raw DeepSpeed dict has the last word)."""
    out = dict(base)
    for k, v in extra.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def zero_section(ds: DeepSpeedSection) -> dict[str, Any]:
    """The `zero_optimization` block of a DeepSpeed config from the typed fields."""
    zero: dict[str, Any] = {"stage": ds.zero_stage}
    if ds.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu"}
    if ds.offload_params:
        zero["offload_param"] = {"device": "cpu"}
    if ds.zero_stage == 3:
        # Gather the full weights on save, so checkpoints hold a loadable HF model.
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    return zero


def engine_config(ds: DeepSpeedSection, micro: int, ranks: int, bf16: bool, batch: int | None = None,
                  lr: float | None = None, weight_decay: float = 0.0, grad_clip: float | None = None,
                  scheduler: dict | None = None) -> dict:
    """The one builder of DeepSpeed config dicts (Ray Train workers and PPO roles alike).

    With `lr`: a trainable engine, AdamW over `batch` rows per optimizer step (accumulating
    micro-batches of `micro` on each of `ranks` ranks), clipped, with an optional `scheduler`
    (none: constant lr). Without: a frozen engine for forward passes only, whose batch size
    DeepSpeed still wants consistent with micro x ranks. The user's raw `ds.extra` is merged last.
    """
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro,
        "zero_optimization": zero_section(ds),
        "bf16": {"enabled": bf16},
        "steps_per_print": 10**9,  # progress is ours (MLflow + console), not DeepSpeed's prints
        "wall_clock_breakdown": False,
    }
    if lr is None:
        config["train_batch_size"] = micro * ranks
    else:
        batch = batch or micro * ranks
        config.update({"train_batch_size": batch, "gradient_accumulation_steps": batch // (micro * ranks),
                       "gradient_clipping": grad_clip,
                       "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": weight_decay,
                                                                 "betas": [0.9, 0.95], "eps": 1e-8}}})
        if scheduler is not None:
            config["scheduler"] = scheduler
    return merge(config, ds.extra)


def for_device(ds_config: dict, device) -> dict:
    """`ds_config` as the process that computes on `device` initialises it (issue 68). On a CUDA device AdamW is
    torch's (`torch_adam`): without it DeepSpeed picks FusedAdam, whose CUDA kernel is JIT-compiled with nvcc,
    which neither the install nor the image provides (and each rank would build it). On a CPU the config is
    unchanged: DeepSpeed's CPU FusedAdam is built at set-up with gcc, and the CPU path stays as measured. A user's
    own `torch_adam` in `deepspeed.extra` is kept."""
    params = ds_config.get("optimizer", {}).get("params")
    if getattr(device, "type", str(device)) != "cuda" or params is None or "torch_adam" in params:
        return ds_config
    return merge(ds_config, {"optimizer": {"params": {"torch_adam": True}}})


def deepspeed_config(cfg: TrainingConfig, total_steps: int, bf16: bool) -> dict:
    """The DeepSpeed config dict for a Ray Train run of `total_steps` optimizer steps."""
    return engine_config(cfg.deepspeed, cfg.micro_batch_size, cfg.num_workers, bf16, cfg.batch_size, cfg.lr,
                         cfg.weight_decay, cfg.grad_clip, lr_scheduler(cfg, total_steps))


def lr_scheduler(cfg: TrainingConfig, total_steps: int) -> dict:
    """DeepSpeed's scheduler block for `cfg.lr_schedule` (warmup, then constant, linear or cosine).

    DeepSpeed's warm-up starts at its minimum and lasts at least 2 steps whatever `warmup_num_steps` says,
    so without a warm-up (`warmup_steps: 0`) the minimum is the peak itself: otherwise the first two steps
    trained at lr 0 and lr/2 (found by bench/peer_trl_dpo.py, whose constant-lr job logged lr 0, 0, 5e-5).
    With a warm-up of w steps, DeepSpeed trains steps 1 and 2 at lr 0 and reaches the peak at step w + 2."""
    warmup = min(cfg.warmup_steps, max(total_steps - 1, 0))
    start = 0.0 if warmup else 1.0  # the warm-up's first lr, as a fraction of the peak
    if cfg.lr_schedule == "constant":
        return {"type": "WarmupLR", "params": {"warmup_min_lr": start * cfg.lr, "warmup_max_lr": cfg.lr,
                                               "warmup_num_steps": max(warmup, 1), "warmup_type": "linear"}}
    if cfg.lr_schedule == "linear":
        return {"type": "WarmupDecayLR", "params": {"warmup_min_lr": start * cfg.lr, "warmup_max_lr": cfg.lr,
                                                    "warmup_num_steps": max(warmup, 1), "warmup_type": "linear",
                                                    "total_num_steps": max(total_steps, warmup + 1)}}
    # WarmupCosineLR reads lr 0 before its first step whatever its minimum: without a warm-up it starts as started
    started = {} if warmup else {"last_batch_iteration": 0}
    return {"type": "WarmupCosineLR", "params": {"total_num_steps": max(total_steps, warmup + 1),
                                                 "warmup_num_steps": max(warmup, 1), "warmup_min_ratio": start,
                                                 "cos_min_ratio": cfg.min_lr_ratio, "warmup_type": "linear", **started}}
