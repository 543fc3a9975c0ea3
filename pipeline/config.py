"""The pipeline's configuration: one YAML file, typed and validated.

    load_config("configs/full.yaml", ["stages.data.max_len=256"])  ->  PipelineConfig

Every section is a pydantic model that rejects unknown keys and documents each field; user
mistakes (bad YAML, unknown key, wrong type, out-of-range value, missing file) become a
`ConfigError` whose lines each name the key path and the fix. The CLI prints it and exits 2.
Relative paths are resolved against the current directory at load time, so Ray workers on other
processes see absolute paths.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, ClassVar

import yaml
from pydantic import Field, ValidationError, create_model, field_validator, model_validator

from pipeline.errors import ConfigError
# The section-generic helpers live in pipeline.schema; re-exported here for callers of the pipeline config.
from pipeline.schema import (Section, apply_override, flatten, format_validation_error, get_path,  # noqa: F401
                             leaf_problem, subsection, to_plain, with_values)
from pipeline.registry import SECTIONS, STAGES, SectionSpec, StageSpec, import_path
from pipeline.registry import load as load_stage
from pipeline.tracking import redact, split_credentials, take_credentials

class StorageConfig(Section):
    """Object storage for artifacts and checkpoints; empty: run_dir alone (a shared path on a cluster)."""

    uri: str | None = Field(
        None,
        description="'s3://bucket/prefix': finished artifacts and training checkpoints are kept in the bucket and "
        "pulled into run_dir (each machine's working copy) when missing there. Lets a multi-node cluster run "
        "without a shared run_dir. Empty: run_dir alone.",
    )
    endpoint_url: str | None = Field(
        None,
        description="S3-compatible endpoint (MinIO, Ceph, GCS interoperability), e.g. 'http://minio:9000'. "
        "Empty: AWS S3. Credentials come from AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or ~/.aws.",
    )
    region: str | None = Field(None, description="Bucket region, e.g. 'us-east-1'. Empty: AWS_DEFAULT_REGION or "
                               "pyarrow's default.")

    @field_validator("uri")
    @classmethod
    def _s3(cls, v: str | None) -> str | None:
        if v is None or not v.strip():
            return None
        v = v.strip().rstrip("/")
        if not v.startswith("s3://") or not v[5:].split("/")[0]:
            raise ValueError(f"{v!r} is not an object-store URI; write s3://BUCKET or s3://BUCKET/PREFIX (a local or "
                             "mounted path belongs in run_dir)")
        return v


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
    num_gpus: int | None = Field(
        None, ge=0,
        description="GPUs of a local Ray instance. Empty: the GPUs Ray finds on this machine (CUDA_VISIBLE_DEVICES if "
        "set); 0: train and generate on the CPU on a GPU machine. Every stage asks Ray for GPUs when the Ray it runs "
        "on has any (a cluster's: its nodes' GPUs), and each process then computes on what Ray gave it.",
    )

    def local_num_cpus(self) -> int:
        return self.num_cpus or max(8, 2 * (os.cpu_count() or 1))

    def local_gpus(self) -> int | None:
        """The GPUs of the local Ray a run starts (`num_gpus`, else what Ray detects here); None when the run joins
        a cluster (its GPUs are counted once the run has joined it)."""
        if self.address or os.environ.get("RAY_ADDRESS"):
            return None
        if self.num_gpus is not None:
            return self.num_gpus
        from pipeline.cluster import detected_gpus

        return detected_gpus()

    def local_cpus(self) -> int | None:
        """The logical CPUs of the local Ray a run starts, known when the config loads; None when the run
        joins a cluster (its size is checked when a stage starts)."""
        return None if self.address or os.environ.get("RAY_ADDRESS") else self.local_num_cpus()


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


class PipelineSettings(Section):
    """A whole post-training run: the settings of the run itself. `PipelineConfig` adds the sections the
    registry names (`pipeline.registry`: the shared top-level sections, then `stages`, one per stage)."""

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
    registry: ClassVar[tuple[StageSpec, ...]] = ()  # the stages it was composed from (`compose`)

    @field_validator("run_dir")
    @classmethod
    def _absolute(cls, v: Path) -> Path:
        return v.expanduser().absolute()

    @model_validator(mode="after")
    def _stages_agree(self) -> "PipelineSettings":
        """Each registered stage's `check` hook, in registry order, configured or not: the rules its section
        keeps with the rest (a reward model to score with, a sweep's target, enough CPUs on a local Ray)."""
        for spec in self.registry:
            load_stage(spec.module).check(self)
        return self

    @property
    def tracking_uri(self) -> str:
        """The store MLflow is given, shown and keyed on: a server's URI without its password (that
        is in MLFLOW_TRACKING_PASSWORD since the config loaded, `tracking.take_credentials`), so
        changing only the password changes no cache key."""
        if self.mlflow.tracking_uri:
            return split_credentials(self.mlflow.tracking_uri)[0]
        return f"sqlite:///{self.run_dir / 'mlflow.db'}"


def _stage_field(presence: str, settings: type[Section], doc: str) -> tuple[Any, Any]:
    """The `stages.<name>` field of a stage's section: always there, there unless null, or empty unless set."""
    if presence == "always":
        return settings, Field(default_factory=settings, description=doc)
    if presence == "default":
        return settings | None, Field(default_factory=settings, description=doc)
    return settings | None, Field(None, description=doc)


def compose(stages: tuple[StageSpec, ...] = STAGES,
            sections: tuple[SectionSpec, ...] = SECTIONS) -> type[PipelineSettings]:
    """The pipeline's config class from a registry: its own settings, the shared sections, then `stages` with
    one section per stage that has a config class. The framework names no stage (docs/architecture.md,
    "Adding a stage"); a test composes one with a toy stage added."""
    stages_config = create_model(
        "StagesConfig", __base__=Section, __doc__="One section per stage (the `model` stage is configured by the "
        "top-level `model` section).",
        **{s.name: _stage_field(s.presence, import_path(s.settings), s.doc) for s in stages if s.settings})
    composed = create_model(
        "PipelineConfig", __base__=PipelineSettings, __doc__="A whole post-training run.",
        **{s.name: (import_path(s.settings), Field(default_factory=import_path(s.settings), description=s.doc))
           for s in sections},
        stages=(stages_config, Field(default_factory=stages_config, description="Per-stage settings.")))
    composed.registry = stages
    return composed


PipelineConfig = compose()


# --------------------------------------------------------------------------- loading


class DuplicateKey(yaml.YAMLError):
    """A key given twice in one mapping: `path` is the mapping's key path, `lines` both keys' lines (1-based)."""

    def __init__(self, key: str, path: tuple[str, ...], lines: tuple[int, int]):
        super().__init__(f"key {key!r} appears twice")
        self.key, self.path, self.lines = key, path, lines

    def where(self, prefix: tuple[str, ...] = ()) -> str:
        path = ".".join((*prefix, *self.path))
        return f"in {path}" if path else "at the top level"


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping. PyYAML has no option for it: its constructor
    keeps the last value without a word (the YAML spec says a mapping's keys are unique), so `lr` written twice
    in a section ran with the second. Every YAML the pipeline reads from the user goes through `_load_yaml`."""

    def construct_document(self, node: yaml.Node) -> Any:
        self._paths: dict[int, tuple[str, ...]] = {}
        self._name_mappings(node, ())
        return super().construct_document(node)

    def _name_mappings(self, node: yaml.Node, path: tuple[str, ...]) -> None:
        """Each mapping node's key path (for the message); an alias (the same node again) is named once."""
        if id(node) in self._paths:
            return
        if isinstance(node, yaml.MappingNode):
            self._paths[id(node)] = path
            for key, value in node.value:
                self._name_mappings(value, (*path, str(key.value) if isinstance(key, yaml.ScalarNode) else "?"))
        elif isinstance(node, yaml.SequenceNode):
            self._paths[id(node)] = path
            for i, value in enumerate(node.value):
                self._name_mappings(value, (*path, str(i)))

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        # Before the base class flattens merge keys (`<<: *base`): a key that overrides a merged one is no duplicate.
        first: dict[Any, int] = {}
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node)
            line = key_node.start_mark.line + 1
            if key in first:
                raise DuplicateKey(str(key), self._paths.get(id(node), ()), (first[key], line))
            first[key] = line
        return super().construct_mapping(node, deep=deep)


def _load_yaml(text: str) -> Any:
    """`yaml.safe_load` that refuses duplicate keys (`DuplicateKey`)."""
    loader = _UniqueKeyLoader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def parse_override(text: str) -> tuple[list[str], Any]:
    """`"stages.data.max_len=256"` -> (['stages', 'data', 'max_len'], 256); values are YAML scalars."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip() or any(not part for part in key.strip().split(".")):
        raise ConfigError(f"override {redact(text)!r}: expected key.path=value, e.g. stages.data.max_len=256")
    try:
        value = _load_yaml(raw) if raw.strip() else None
    except DuplicateKey as exc:
        where = exc.where(tuple(key.strip().split(".")))
        raise ConfigError(f"override {redact(text)!r}: key {exc.key!r} appears twice {where}; keep one") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {redact(text)!r}: value is not valid YAML ({exc.problem})") from None
    return key.strip().split("."), value


def _read_yaml(path: Path) -> dict:
    if not path.is_file():
        raise ConfigError(f"config file not found: {path} (give the path to a YAML file, e.g. configs/full.yaml)")
    try:
        data = _load_yaml(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a UTF-8 text file; save the YAML as UTF-8") from None
    except DuplicateKey as exc:
        raise ConfigError(f"{path}: key {exc.key!r} appears twice {exc.where()} (lines {exc.lines[0]} and "
                          f"{exc.lines[1]}); keep one") from None
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


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = (),
                schema: type[PipelineSettings] | None = None) -> PipelineConfig:
    """Read, override and validate a pipeline YAML (None: the defaults); raise `ConfigError` on any user mistake.
    `schema`: a config class composed from another registry (`compose`); default PipelineConfig."""
    schema = schema or PipelineConfig
    path = Path(path) if path is not None else Path("(defaults)")
    data = _read_yaml(path) if str(path) != "(defaults)" else {}
    for text in overrides:
        apply_override(data, *parse_override(text))
    try:
        return schema.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"{path}: invalid configuration\n{format_validation_error(exc, schema)}") from None


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
