"""Fake finished runs for the tests that find policies in run directories (tests/test_compare.py,
tests/test_distill_oracle.py): manifests and held-out prompts only, no models trained."""

from __future__ import annotations

import json
from pathlib import Path


def fake_run(run_dir: Path, stages: dict[str, str], prompts: list[str], verifier: str = "number",
             gold: str | None = None, ids: list[int] = (1, 2)) -> Path:
    """A run directory with a finished manifest per stage (stage -> finished time) and held-out prompts."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    eval_dir = run_dir / "artifacts" / "data" / "d0" / "prompts" / "eval"
    eval_dir.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist([{"prompt": p, "prompt_ids": list(ids), "answer": "1"} for p in prompts]),
                   eval_dir / "part.parquet")
    output = {"ppo": "policy_model", "dpo": "dpo_model", "sft": "sft_model"}
    for stage, finished in stages.items():
        key = f"{stage}key"
        out = run_dir / "artifacts" / stage / key
        (out / "model").mkdir(parents=True)
        config = {"task.verifier": verifier, **({"task.preference": {"gold": gold}} if gold else {})}
        (out / "manifest.json").write_text(json.dumps({
            "stage": stage, "key": key, "finished": finished, "outputs": {output[stage]: "model"},
            "components": {"config": config, "upstream": {"prompt_data": "d0"}}}))
    return run_dir
