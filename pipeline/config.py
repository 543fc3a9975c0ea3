"""The pipeline's configuration: one YAML file, typed and validated.

    load_config("configs/full.yaml", ["stages.data.max_len=256"])  ->  PipelineConfig

Every section is a pydantic model that rejects unknown keys and documents each field; user
mistakes (bad YAML, unknown key, wrong type, out-of-range value, missing file) become a
`ConfigError` whose lines each name the key path and the fix. The CLI prints it and exits 2.
Relative paths are resolved against the current directory at load time, so Ray workers on other
processes see absolute paths.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from pipeline.errors import ConfigError
# The section-generic helpers live in pipeline.schema; re-exported here for callers of the pipeline config.
from pipeline.schema import (Section, apply_override, flatten, format_validation_error, get_path,  # noqa: F401
                             to_plain, with_values)
from pipeline.storage import StorageConfig
from pipeline.tracking import redact, split_credentials, take_credentials
from stages.batch_infer import BatchInferConfig
from stages.common.models import ModelConfig
from stages.common.tasks import TaskConfig
from stages.data import DataConfig
from stages.dpo import DPOConfig
from stages.ppo import PPOConfig
from stages.reward import RewardConfig
from stages.serve import ServeConfig
from stages.sft import SFTConfig
from stages.tune import TuneConfig


class RayConfig(Section):
    """How to reach Ray. Local by default; `address` (or the RAY_ADDRESS variable) joins a cluster."""

    address: str | None = Field(
        None,
        description="Cluster to join: 'auto', 'host:port' or 'ray://host:10001'. Empty: start a local "
        "Ray instance for the run (RAY_ADDRESS in the environment wins over a local start).",
    )
    num_cpus: int | None = Field(
        None,
        ge=1,
        description="Logical CPUs of a local Ray instance. Empty: max(8, 2 x cores), oversubscribed on "
        "purpose because engines, trainers and Serve replicas each reserve a CPU (docs/architecture.md, fact 6).",
    )
    object_store_memory_gb: float | None = Field(
        None, gt=0, description="Object store size of a local Ray instance in GiB. Empty: Ray's default."
    )

    def local_num_cpus(self) -> int:
        return self.num_cpus or max(8, 2 * (os.cpu_count() or 1))


class MlflowConfig(Section):
    """Experiment tracking."""

    tracking_uri: str | None = Field(
        None,
        description="MLflow tracking URI ('http://host:5000', 'sqlite:///path.db', ...). Empty: a "
        "SQLite store at <run_dir>/mlflow.db. A server's credentials: 'https://USER:PASSWORD@host' "
        "(percent-escape special characters, e.g. %2F for '/'), or 'https://USER@host' with the password in "
        "MLFLOW_TRACKING_PASSWORD; they are taken out of the URI at load and passed as MLflow reads them "
        "(MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD, also to Ray workers); no output, log, "
        "MLflow run or cache key shows the password, and changing it reruns nothing.",
    )
    experiment: str = Field("posttrain", min_length=1, description="MLflow experiment that holds the runs.")

    @field_validator("tracking_uri")
    @classmethod
    def _credentials_to_environment(cls, v: str | None) -> str | None:
        # At load: the password goes to the environment, never into the config (tracking.take_credentials).
        return take_credentials(v) if v else v


class StagesConfig(Section):
    """One section per stage (the `model` stage is configured by the top-level `model` section)."""

    data: DataConfig = Field(default_factory=DataConfig, description="The data stage (Ray Data).")
    sft: SFTConfig | None = Field(default_factory=SFTConfig, description="The sft stage (Ray Train + DeepSpeed); "
                                  "null: no SFT, RL (and the reward model) start from the base model.")
    reward: RewardConfig | None = Field(default_factory=RewardConfig, description="The reward stage (Ray Train + "
                                        "DeepSpeed); null: no reward model (RL on a rule reward alone; PPO's critic "
                                        "then starts from the SFT model).")
    dpo: DPOConfig | None = Field(None, description="The dpo stage (Ray Train + DeepSpeed): DPO, IPO, SimPO or KTO "
                                  "on the preference pairs, no reward model; empty: no such stage. Serve its model "
                                  "with stages.serve.source: dpo_model.")
    ppo: PPOConfig | None = Field(default_factory=PPOConfig, description="The ppo stage (vLLM rollouts + DeepSpeed "
                                  "roles); null: no RL (serve takes the SFT model).")
    serve: ServeConfig | None = Field(default_factory=ServeConfig, description="The serve stage (MLflow Model "
                                      "Registry + Ray Serve LLM); null: no such stage (nothing is registered or "
                                      "served; the serve and batch-infer commands still work, with this section's "
                                      "defaults).")
    batch_infer: BatchInferConfig | None = Field(None, description="The batch_infer stage (Ray Data LLM over a "
                                                 "prompts dataset); empty: no such stage (the batch-infer command "
                                                 "still works).")
    tune: TuneConfig | None = Field(None, description="The tune stage (Ray Tune sweep over sft, reward, dpo or ppo); "
                                    "empty: no sweep. See docs/tune.md.")


    @model_validator(mode="after")
    def _a_graph_that_can_run(self) -> "StagesConfig":
        """The stage graph follows the config: a null stage is left out, and what needs it is refused here,
        naming the key, rather than failing when the stage runs."""
        ppo, reward, sft = self.ppo, self.reward, self.sft
        if ppo is not None and reward is None and ppo.rewards.model_weight:
            raise ValueError(f"stages.ppo.rewards.model_weight is {ppo.rewards.model_weight:g} but stages.reward is "
                             "null: there is no reward model to score with; set stages.ppo.rewards.model_weight: 0 "
                             "(the rule reward alone) or configure stages.reward")
        for name in ("reward", "dpo"):
            section = getattr(self, name)
            if section is not None and sft is None and section.init_from == "sft":
                raise ValueError(f"stages.{name}.init_from is sft but stages.sft is null; set stages.{name}.init_from: base")
        dpo = self.dpo
        made = {"base_model", *(["sft_model"] if sft else []), *(["policy_model"] if ppo else []),
                *(["dpo_model"] if dpo else [])}
        # serve's source defaults to the last model trained (sections are frozen once validated)
        if self.serve is not None and self.serve.source is None:
            last = "policy_model" if ppo else "dpo_model" if dpo else "sft_model" if sft else "base_model"
            object.__setattr__(self, "serve", self.serve.model_copy(update={"source": last}))
        for key, source in (("serve", self.serve.source if self.serve else None),
                            ("batch_infer", self.batch_infer.source if self.batch_infer else None)):
            if source and source not in made:
                stage = {"policy_model": "ppo", "dpo_model": "dpo"}.get(source, "sft")
                raise ValueError(f"stages.{key}.source is {source} but stages.{stage} is null; use one of "
                                 f"{', '.join(sorted(made))}")
        if self.batch_infer is not None and self.batch_infer.score.reward_model and reward is None:
            raise ValueError("stages.batch_infer.score.reward_model is true but stages.reward is null; set it to false")
        if self.tune is not None and getattr(self, self.tune.target) is None:
            raise ValueError(f"stages.tune.target is {self.tune.target} but stages.{self.tune.target} is null")
        return self

    def present(self) -> list[str]:
        """The optional training stages this pipeline runs."""
        return [name for name in ("sft", "reward", "dpo", "ppo") if getattr(self, name) is not None]

    def serve_settings(self) -> ServeConfig:
        """The serve section the `serve` and `batch-infer` commands read (registry name, engine, endpoint):
        a pipeline without a serve stage (`stages.serve: null`) may still serve a model by hand, with the
        section's defaults."""
        return self.serve if self.serve is not None else ServeConfig()


class PipelineConfig(Section):
    """A whole post-training run."""

    run_dir: Path = Field(
        Path("runs/default"),
        description="Where artifacts, checkpoints, the lock file and the default MLflow store live.",
    )
    min_free_gb: float = Field(
        1.0, ge=0,
        description="Refuse to start when run_dir's filesystem has less free space than this (GiB): a full disk "
        "then fails before any work, not in the middle of a checkpoint.",
    )
    storage: StorageConfig = Field(default_factory=StorageConfig, description="Object storage (s3://) for "
                                   "artifacts and checkpoints; empty: run_dir is the storage of record.")
    seed: int = Field(0, ge=0, description="Seed for data generation, splits, model init and training.")
    ray: RayConfig = Field(default_factory=RayConfig, description="Ray connection settings.")
    mlflow: MlflowConfig = Field(default_factory=MlflowConfig, description="MLflow tracking settings.")
    model: ModelConfig = Field(default_factory=ModelConfig, description="Base model and tokenizer source.")
    task: TaskConfig = Field(default_factory=TaskConfig, description="The generated task (data, rewards, accuracy).")
    stages: StagesConfig = Field(default_factory=StagesConfig, description="Per-stage settings.")

    @field_validator("run_dir")
    @classmethod
    def _absolute(cls, v: Path) -> Path:
        return v.expanduser().absolute()

    @model_validator(mode="after")
    def _fits_the_model(self) -> "PipelineConfig":
        limit = self.model.builtin.max_position_embeddings
        if self.model.is_builtin and self.stages.data.max_len > limit:
            raise ValueError(f"stages.data.max_len ({self.stages.data.max_len}) exceeds "
                             f"model.builtin.max_position_embeddings ({limit}); lower one or raise the other")
        return self

    @model_validator(mode="after")
    def _tune_fits_its_target(self) -> "PipelineConfig":
        tune = self.stages.tune
        for name in self.stages.present():
            if getattr(self.stages, name).use_tuned and (tune is None or tune.target != name):
                raise ValueError(f"stages.{name}.use_tuned: there is no sweep over {name} to take values from; add "
                                 f"stages.tune with target: {name}, or set use_tuned: false")
        if tune is None:
            return self
        target = getattr(self.stages, tune.target)
        for path, dim in tune.search_space.items():
            key = f"stages.tune.search_space.{path}"
            problem = leaf_problem(type(target), path, f"stages.{tune.target}")
            if problem:
                raise ValueError(f"{key}: {problem}")
            for value in dim.candidates():  # every listed value (or both bounds) must be valid for the target
                try:
                    with_values(target, {path: value}, prefix=f"stages.{tune.target}")
                except ValueError as exc:
                    raise ValueError(f"{key}: {dim.kind} value {value!r} is invalid for stages.{tune.target}: {exc}") from None
        return self

    @model_validator(mode="after")
    def _fits_local_ray(self) -> "PipelineConfig":
        # A local Ray's size is known now; a cluster's is checked when the stage starts.
        if self.ray.address or os.environ.get("RAY_ADDRESS"):
            return self
        ppo, have = self.stages.ppo, self.ray.local_num_cpus()
        if ppo is not None and ppo.cpus_needed() > have:
            raise ValueError(f"stages.ppo.rollout.num_engines: the roles and {ppo.rollout.num_engines} engines need "
                             f"{ppo.cpus_needed():g} logical CPUs but the local Ray has {have} (ray.num_cpus); use "
                             "fewer engines or ranks, or raise ray.num_cpus")
        serve = self.stages.serve
        if serve is not None and serve.deploy and serve.cpus_needed() > have:
            raise ValueError(f"stages.serve.replicas: {serve.replicas} replica(s) need {serve.cpus_needed()} logical "
                             f"CPUs (2 each + the ingress) but the local Ray has {have} (ray.num_cpus); use fewer "
                             "replicas or raise ray.num_cpus")
        tune = self.stages.tune
        if tune is not None:
            target = getattr(self.stages, tune.target)
            per_trial = tune.resources_per_trial.cpu + (target.cpus_needed() if tune.target == "ppo" else target.num_workers)
            if per_trial * tune.max_concurrent_trials > have:
                raise ValueError(f"stages.tune.max_concurrent_trials: {tune.max_concurrent_trials} trials of "
                                 f"{tune.target} need {per_trial:g} logical CPUs each (driver + workers), "
                                 f"{per_trial * tune.max_concurrent_trials:g} in all, but the local Ray has {have} "
                                 "(ray.num_cpus); run fewer trials at once or raise ray.num_cpus")
        return self

    @property
    def tracking_uri(self) -> str:
        """The store MLflow is given, shown and keyed on: a server's URI without its password (that
        is in MLFLOW_TRACKING_PASSWORD since the config loaded, `tracking.take_credentials`), so
        changing only the password changes no cache key."""
        if self.mlflow.tracking_uri:
            return split_credentials(self.mlflow.tracking_uri)[0]
        return f"sqlite:///{self.run_dir / 'mlflow.db'}"


# --------------------------------------------------------------------------- loading


def parse_override(text: str) -> tuple[list[str], Any]:
    """`"stages.data.max_len=256"` -> (['stages', 'data', 'max_len'], 256); values are YAML scalars."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip() or any(not part for part in key.strip().split(".")):
        raise ConfigError(f"override {redact(text)!r}: expected key.path=value, e.g. stages.data.max_len=256")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {redact(text)!r}: value is not valid YAML ({exc.problem})") from None
    return key.strip().split("."), value


def _read_yaml(path: Path) -> dict:
    if not path.is_file():
        raise ConfigError(f"config file not found: {path} (give the path to a YAML file, e.g. configs/full.yaml)")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a UTF-8 text file; save the YAML as UTF-8") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"{path}: invalid YAML{where}: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections (run_dir:, stages:, ...)")
    return data


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> PipelineConfig:
    """Read, override and validate a pipeline YAML (None: the defaults); raise `ConfigError` on any user mistake."""
    path = Path(path) if path is not None else Path("(defaults)")
    data = _read_yaml(path) if str(path) != "(defaults)" else {}
    for text in overrides:
        apply_override(data, *parse_override(text))
    try:
        return PipelineConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"{path}: invalid configuration\n{format_validation_error(exc, PipelineConfig)}") from None


def leaf_problem(model: type[Section], dotted: str, prefix: str) -> str | None:
    """Why `dotted` is not a settable value field of `model` (None if it is): for search spaces."""
    node: Any = model
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        fields = getattr(node, "model_fields", {})
        if part not in fields or part == "use_tuned":
            valid = sorted(f for f in fields if f != "use_tuned")
            close = difflib.get_close_matches(part, valid, n=1)
            where = ".".join([prefix, *parts[:i]])
            return (f"not a field of {where}; " + (f"did you mean '{close[0]}'? " if close else "")
                    + f"fields there: {', '.join(valid)}")
        inner, placeholder = subsection(fields[part].annotation)  # a section, or an optional one (`X | None`)
        is_section = inner is not None and not placeholder
        node = inner if is_section else fields[part].annotation
        if i == len(parts) - 1 and is_section:
            return f"is a section, not a value; name one of its fields, e.g. {dotted}.{next(iter(node.model_fields))}"
        if i < len(parts) - 1 and not is_section:
            return f"{'.'.join(parts[: i + 1])} is a value, not a section"
    return None


def subsection(annotation: Any) -> tuple[type[Section] | None, str]:
    """The Section class a field holds, directly, as `X | None`, or as the values of `dict[str, X]` or the
    items of `list[X]` (then with the key or index placeholder to show in paths)."""
    import typing

    if isinstance(annotation, type) and issubclass(annotation, Section):
        return annotation, ""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is dict and len(args) == 2:
        inner, _ = subsection(args[1])
        return inner, ".<field path>" if inner else ""
    if typing.get_origin(annotation) is list and len(args) == 1:
        inner, _ = subsection(args[0])
        return inner, "[i]" if inner else ""
    sections = [a for a in args if isinstance(a, type) and issubclass(a, Section)]
    return (sections[0], "") if len(sections) == 1 and set(args) <= {sections[0], type(None)} else (None, "")


def reference(model: type[Section] = PipelineConfig, prefix: str = "") -> list[tuple[str, str, str]]:
    """(key path, default, description) for every option: the config reference, docs/configuration.md."""
    rows = []
    for name, f in model.model_fields.items():
        path = f"{prefix}{f.alias or name}"  # the YAML key (`async` is a Python keyword: field async_)
        sub, key = subsection(f.annotation)
        if sub is not None:
            rows.append((path, "", f.description or ""))
            rows += reference(sub, path + key + ".")
        else:
            default = "(required)" if f.is_required() else json_default(f.get_default(call_default_factory=True))
            rows.append((path, default, f.description or ""))
    return rows


def json_default(value: Any) -> str:
    import json

    return json.dumps(value if not isinstance(value, Path) else str(value))
