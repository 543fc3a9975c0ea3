"""A run's trained policy, found from its files (or its MLflow run id): `pipeline compare`'s A and B, and a
distillation teacher (`stages.ppo.distill.teacher`).

A run directory means its final policy: the graph's last finished policy stage (ppo, else dpo, else sft; `DIR:STAGE`
picks one), that stage's newest artifact; a stage's
artifact directory (`<run_dir>/artifacts/<stage>/<key>`) means that one; an MLflow run id (of a pipeline run
or of one of its stage runs) means the artifact that run made, on this machine. Reads manifests only:
nothing is loaded or trained here.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from pipeline.errors import UserError

POLICY_STAGES = ("ppo", "dpo", "sft")  # the stages whose output is a policy, the graph's last one first
OUTPUT = {"ppo": "policy_model", "dpo": "dpo_model", "sft": "sft_model"}
RUN_ID = re.compile(r"^[0-9a-f]{32}$")
FORMS = ("a run directory (DIR, or DIR:STAGE with STAGE one of ppo, dpo, sft), a stage's artifact directory "
         "(<run_dir>/artifacts/<stage>/<key>), or an MLflow run id (with --tracking-uri or MLFLOW_TRACKING_URI)")


@dataclass
class Policy:
    """One side of the comparison: a finished policy stage of some run, and what it was trained on."""

    given: str  # what the user passed
    stage: str
    key: str
    run_dir: Path
    manifest: dict

    @property
    def model_dir(self) -> Path:
        # pipeline.storage's layout (artifact_dir, output_paths), inlined: importing it here would make every
        # ppo stage's cache key cover the storage code (its config finds a distillation teacher with this module)
        out = Path(self.run_dir) / "artifacts" / self.stage / self.key
        given = Path(self.manifest["outputs"][OUTPUT[self.stage]])
        return given if given.is_absolute() else out / given

    @property
    def config(self) -> dict:
        return self.manifest["components"]["config"]

    @property
    def data_key(self) -> str | None:
        return self.manifest["components"].get("upstream", {}).get("prompt_data")

    @property
    def prompts_dir(self) -> Path:
        return self.run_dir / "artifacts" / "data" / str(self.data_key) / "prompts" / "eval"

    def describe(self) -> str:
        return f"{self.given}: {self.stage} {self.key} ({self.model_dir})"


def _read_manifest(path: Path) -> dict | None:
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) and manifest.get("stage") in POLICY_STAGES else None


def _from_artifact_dir(given: str, directory: Path) -> Policy:
    manifest = _read_manifest(directory / "manifest.json")
    if manifest is None:
        raise UserError(f"{given}: {directory / 'manifest.json'} is not a finished ppo, dpo or sft stage's "
                        f"manifest; give {FORMS}")
    return Policy(given, manifest["stage"], manifest["key"], directory.parents[2], manifest)


def _final(given: str, run_dir: Path, stage: str | None) -> Policy:
    """The run directory's final policy: its graph's last policy stage that has finished (ppo, else dpo, else sft;
    `stage` if given), that stage's newest artifact. Not the newest of all: `--only sft --force sft` after a
    whole run finishes an sft artifact after the ppo one, and `compare DIR:sft DIR` was refused as "the same
    policy" (issue 59, item 5)."""
    for name in (stage,) if stage else POLICY_STAGES:
        found = [m for path in (run_dir / "artifacts" / name).glob("*/manifest.json")
                 if (m := _read_manifest(path)) is not None]
        if found:
            manifest = max(found, key=lambda m: str(m.get("finished", "")))
            return Policy(given, manifest["stage"], manifest["key"], run_dir, manifest)
    stages = (stage,) if stage else POLICY_STAGES
    raise UserError(f"{given}: no finished {' or '.join(stages)} stage under {run_dir / 'artifacts'}; run the "
                    f"pipeline there first, or give {FORMS}")


def _from_run_id(given: str, tracking_uri: str | None) -> Policy:
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    if not tracking_uri:
        raise UserError(f"{given}: an MLflow run id needs the tracking store: pass --tracking-uri URI or set "
                        "MLFLOW_TRACKING_URI")
    client = MlflowClient(tracking_uri)
    try:
        run = client.get_run(given)
    except MlflowException as exc:
        raise UserError(f"{given}: no such MLflow run in {tracking_uri} ({str(exc).splitlines()[0]})") from None
    if "stage" not in run.data.tags:  # a pipeline run: its policy stage's run
        children = client.search_runs([run.info.experiment_id], f"tags.mlflow.parentRunId = '{given}'")
        by_stage = {c.data.tags.get("stage"): c for c in children}
        stage = next((s for s in POLICY_STAGES if s in by_stage), None)
        if stage is None:
            raise UserError(f"{given}: this pipeline run has no ppo, dpo or sft stage run")
        parent, run = given, by_stage[stage]
    else:
        parent = run.data.tags.get("mlflow.parentRunId")
    stage, key = run.data.tags["stage"], run.data.tags.get("cache_key")
    if stage not in POLICY_STAGES or not key or not parent:
        raise UserError(f"{given}: the run of stage {stage!r} holds no policy; give a ppo, dpo or sft stage's run")
    resolved = json.loads(Path(client.download_artifacts(parent, "resolved_config.json")).read_text())
    directory = Path(resolved["run_dir"]) / "artifacts" / stage / key
    if not (directory / "manifest.json").is_file():
        raise UserError(f"{given}: its artifact {directory} is not on this machine (the run's run_dir); compare "
                        "where the run was made, or copy its run directory here")
    return _from_artifact_dir(given, directory)


def find_policy(given: str, tracking_uri: str | None = None) -> Policy:
    """A or B, in any of `FORMS`, as a `Policy`."""
    path, _, stage = given.partition(":") if not Path(given).exists() else (given, "", "")
    directory = Path(path).expanduser().absolute()
    if stage and stage not in POLICY_STAGES:
        raise UserError(f"{given}: {stage!r} is not a policy stage; use one of {', '.join(POLICY_STAGES)}")
    if (directory / "manifest.json").is_file():
        return _from_artifact_dir(given, directory)
    if (directory / "artifacts").is_dir():
        return _final(given, directory, stage or None)
    if RUN_ID.match(given):
        return _from_run_id(given, tracking_uri)
    raise UserError(f"{given}: not found; give {FORMS}")
