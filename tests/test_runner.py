"""The cached runner on toy stages: what hits, what misses and why, partial artifacts, locking."""

from __future__ import annotations

import sys
import textwrap

import pytest
from rich.console import Console

from conftest import SMOKE, run_cli, smoke_config
from pipeline import artifacts, storage
from pipeline.errors import UserError
from pipeline.registry import StageSpec
from pipeline.runner import RunLock, build_plan, run_pipeline

# The costly starts this module makes (tests/helpers/starts.py; docs/development.md, "Start-up allowance").
STARTS = {"pipelines": 41}

TOY_A = '''
from pathlib import Path
def raw_inputs(pcfg):
    return [f for src in pcfg.stages.data.sources.sft for f in src.files()]
def run(cfg, ctx):
    with open(ctx.pipeline.run_dir / "executions.log", "a") as f:
        f.write("a\\n")
    # a step counter in its checkpoints, as a training stage resumes from them
    ckpt = ctx.checkpoint_dir / "step"
    start = int(ckpt.read_text()) if ckpt.exists() else 0
    ctx.checkpoint_dir.mkdir(parents=True, exist_ok=True)
    ckpt.write_text(str(start + 1))
    (ctx.out_dir / "started_at_step.txt").write_text(str(start))
    (ctx.out_dir / "partial.txt").write_text("half")
    if (ctx.pipeline.run_dir / "FAIL_A").exists():
        raise RuntimeError("boom")
    (ctx.out_dir / "a.txt").write_text(str(cfg.max_len))
    ctx.log_metrics({"a_metric": 1.5})
    return {"a_out": ctx.out_dir / "a.txt"}
'''
TOY_B = '''
def run(cfg, ctx):
    with open(ctx.pipeline.run_dir / "executions.log", "a") as f:
        f.write("b\\n")
    (ctx.out_dir / "b.txt").write_text(ctx.inputs["a_out"].read_text() + "+b")
    return {"b_out": ctx.out_dir / "b.txt"}
'''
TOY_C = '''
def run(cfg, ctx):
    with open(ctx.pipeline.run_dir / "executions.log", "a") as f:
        f.write("c\\n")
    (ctx.out_dir / "c.txt").write_text("c")
    (ctx.out_dir / "weights.bin").write_bytes(bytes(range(256)) * 8192)  # 2 MiB, as a model shard
    return {"c_out": ctx.out_dir / "c.txt"}
'''
WEIGHTS = bytes(range(256)) * 8192
REGISTRY = (
    StageSpec("toy_a", "toy_a", "stages.data", ("seed",), (), ("a_out",), "a"),
    StageSpec("toy_b", "toy_b", "stages.data.generate", (), ("a_out",), ("b_out",), "b"),
    StageSpec("toy_c", "toy_c", "model", (), (), ("c_out",), "c"),
)


@pytest.fixture
def toy(tmp_path, monkeypatch, tracking_uri):
    code = tmp_path / "code"
    code.mkdir()
    for name, src in (("toy_a", TOY_A), ("toy_b", TOY_B), ("toy_c", TOY_C)):
        (code / f"{name}.py").write_text(textwrap.dedent(src))
    monkeypatch.syspath_prepend(str(code))
    raw = tmp_path / "raw.jsonl"
    raw.write_text('{"prompt": "a", "response": "b"}\n')
    run_dir = tmp_path / "run"

    class Toy:
        def cfg(self, *overrides):
            return smoke_config(run_dir, f"mlflow.tracking_uri={tracking_uri}", f"stages.data.sources.sft=[{raw}]",
                                *overrides)

        def plan(self, *overrides, **kw):
            return {p.spec.name: p for p in build_plan(self.cfg(*overrides), registry=REGISTRY, **kw)}

        def run(self, *overrides, **kw):
            cfg = self.cfg(*overrides)
            log = run_dir / "executions.log"
            before = log.read_text().split() if log.exists() else []
            run_pipeline(cfg, SMOKE, Console(quiet=True), registry=REGISTRY, **kw)
            return sorted(log.read_text().split()[len(before):])

    yield Toy(), code, raw, run_dir
    for name in ("toy_a", "toy_b", "toy_c"):
        sys.modules.pop(name, None)


def test_rerun_with_nothing_changed_recomputes_nothing(toy):
    t, *_ = toy
    assert t.run() == ["a", "b", "c"]
    assert t.run() == []
    assert {p.status for p in t.plan().values()} == {"hit"}


def test_a_run_keys_each_stage_once_and_checks_a_hits_files_once(toy, monkeypatch):
    """One plan per run: every stage is keyed once (its components computed once) and a cached
    artifact's files are checked against its manifest once, whether it is a hit or another stage's input."""
    from collections import Counter

    from pipeline import plan as plan_mod

    t, *_ = toy
    t.run()
    keyed, checked = Counter(), Counter()
    components, damage = plan_mod.components, storage.damage

    def counted_components(cfg, spec, *args, **kwargs):
        keyed[spec.name] += 1
        return components(cfg, spec, *args, **kwargs)

    def counted_damage(manifest, out_dir, *args, **kwargs):
        checked[out_dir.parent.name] += 1
        return damage(manifest, out_dir, *args, **kwargs)

    monkeypatch.setattr(plan_mod, "components", counted_components)
    monkeypatch.setattr(storage, "damage", counted_damage)
    assert t.run() == []  # all hits; toy_b's input is toy_a's artifact
    assert keyed == checked == {"toy_a": 1, "toy_b": 1, "toy_c": 1}
    keyed.clear(), checked.clear()
    assert t.run("stages.data.max_len=77") == ["a", "b"]  # toy_b reads toy_a's fresh output as it is
    assert keyed == {"toy_a": 1, "toy_b": 1, "toy_c": 1} and checked == {"toy_c": 1}


def test_planning_asks_the_store_once_per_stage(toy):
    """The planner gets what it needs about a stage (hit, where, why not, the last attempt) in one answer
    from the store (`ArtifactStore.lookup`), hit or miss, and asks nothing else."""
    from pipeline import plan as plan_mod

    t, *_ = toy
    t.run()
    asked: list[tuple[str, str]] = []

    class Counted:
        def __init__(self, store):
            self.store = store

        def __getattr__(self, name):
            value = getattr(self.store, name)
            if callable(value):
                def call(*args, **kwargs):
                    asked.append((name, args[0] if args else ""))
                    return value(*args, **kwargs)
                return call
            return value

    def plan(*overrides):
        cfg = t.cfg(*overrides)
        selection = plan_mod.selection(cfg, registry=REGISTRY)
        planner = plan_mod.Planner(cfg, *selection, Counted(storage.ArtifactStore.of(cfg)))
        asked.clear()
        return {p.spec.name: p for p in plan_mod.build_plan(cfg, planner=planner)}

    assert {p.status for p in plan().values()} == {"hit"}
    assert sorted(asked) == [("lookup", "toy_a"), ("lookup", "toy_b"), ("lookup", "toy_c")]
    missed = plan("stages.data.max_len=99")  # a miss says what changed since the last attempt: same one answer
    assert "config changed: stages.data.max_len" in missed["toy_a"].reason
    assert sorted(asked) == [("lookup", "toy_a"), ("lookup", "toy_b"), ("lookup", "toy_c")]


def test_config_change_reruns_the_stage_and_downstream_only(toy):
    t, *_ = toy
    t.run()
    plan = t.plan("stages.data.max_len=99")
    assert plan["toy_a"].status == "miss" and "config changed: stages.data.max_len" in plan["toy_a"].reason
    assert plan["toy_b"].status == "miss" and "upstream changed: a_out" in plan["toy_b"].reason
    assert plan["toy_c"].status == "hit"
    assert t.run("stages.data.max_len=99") == ["a", "b"]
    assert (t.cfg().run_dir / "artifacts").exists()


def test_code_change_reruns_the_stage_and_downstream_only(toy):
    t, code, _, _ = toy
    t.run()
    (code / "toy_a.py").write_text((code / "toy_a.py").read_text() + "\n# edited\n")
    plan = t.plan()
    assert plan["toy_a"].status == "miss" and "code changed" in plan["toy_a"].reason
    assert [plan[n].status for n in ("toy_b", "toy_c")] == ["miss", "hit"]
    assert t.run() == ["a", "b"]


def test_raw_data_change_reruns_the_stage_and_downstream_only(toy):
    t, _, raw, _ = toy
    t.run()
    raw.write_text('{"prompt": "a", "response": "changed"}\n')
    plan = t.plan()
    assert "raw inputs changed" in plan["toy_a"].reason
    assert t.run() == ["a", "b"]


def test_a_crashed_stage_leaves_no_artifact_and_reruns(toy):
    t, _, _, run_dir = toy
    (run_dir).mkdir(parents=True, exist_ok=True)
    (run_dir / "FAIL_A").write_text("")
    with pytest.raises(RuntimeError, match="boom"):
        t.run()
    plan = t.plan()
    store = storage.ArtifactStore(run_dir)
    out = store.local_dir("toy_a", plan["toy_a"].key)
    work = store.staging_dir("toy_a", plan["toy_a"].key)
    assert (work / "partial.txt").exists() and not (work / "manifest.json").exists() and not out.exists()
    assert plan["toy_a"].status == "miss" and "did not finish" in plan["toy_a"].reason
    (run_dir / "FAIL_A").unlink()
    assert t.run() == ["a", "b", "c"]
    assert (out / "manifest.json").exists() and (out / "a.txt").exists()


def test_corrupt_manifest_is_not_a_hit(toy):
    t, _, _, run_dir = toy
    t.run()
    key = t.plan()["toy_c"].key
    (storage.artifact_dir(run_dir, "toy_c", key) / "manifest.json").write_text('{"key": "trunc')
    assert t.plan()["toy_c"].status == "miss"


def test_selection_only_from_to_and_force(toy):
    t, *_ = toy
    assert {n for n, p in t.plan(only=["toy_c"]).items() if p.status != "skip"} == {"toy_c"}
    assert {n for n, p in t.plan(to="toy_a").items() if p.status != "skip"} == {"toy_a"}
    t.run()
    assert {n for n, p in t.plan(from_="toy_a").items() if p.status != "skip"} == {"toy_a", "toy_b"}
    assert t.run(only=["toy_b"], force=["toy_b"]) == ["b"]
    assert t.run(force=["all"]) == ["a", "b", "c"]


def test_only_a_stage_whose_inputs_are_missing_names_the_stage_to_run_first(toy):
    t, *_ = toy
    with pytest.raises(UserError, match="needs the output of stage 'toy_a'.*--from toy_a"):
        t.plan(only=["toy_b"])


def test_metrics_of_a_cached_stage_are_kept_in_its_manifest(toy):
    t, _, _, run_dir = toy
    t.run()
    key = t.plan()["toy_a"].key
    manifest = storage.ArtifactStore(run_dir).manifest("toy_a", key)
    assert manifest["metrics"] == {"a_metric": 1.5}
    assert manifest["outputs"] == {"a_out": "a.txt"}


def test_second_run_on_a_busy_run_dir_refuses(tmp_path):
    with RunLock(tmp_path / "run"):
        result = run_cli("run", str(SMOKE), f"run_dir={tmp_path / 'run'}")
    assert result.returncode == 3  # "locked": try again later
    assert "another pipeline run" in result.stderr and str(tmp_path / "run") in result.stderr
    assert not (tmp_path / "run" / "artifacts").exists()


def test_library_upgrade_reruns_everything(toy, monkeypatch):
    t, *_ = toy
    t.run()
    real = artifacts.library_versions()
    monkeypatch.setattr(artifacts, "library_versions", lambda: {**real, "transformers": "99.0"})
    plan = t.plan()
    assert all(p.status == "miss" for p in plan.values())
    assert plan["toy_c"].reason == "libraries changed: transformers"


def test_with_an_object_store_an_empty_run_dir_pulls_and_the_bucket_is_kept_complete(toy):
    import shutil

    from helpers.s3 import S3Server

    t, _, _, run_dir = toy
    with S3Server() as s3:
        args = (f"storage.uri=s3://{s3.bucket}/toy", f"storage.endpoint_url={s3.endpoint}")
        store = s3.store("toy")
        remote = storage.ArtifactStore(run_dir, store).remote
        assert t.run(*args) == ["a", "b", "c"]
        keys = {name: p.key for name, p in t.plan(*args).items()}
        assert all(remote(name, key)[0] for name, key in keys.items())

        # An empty run_dir on the same bucket (a new machine): every stage is a hit, pulled, nothing runs.
        shutil.rmtree(run_dir / "artifacts")
        assert all(p.status == "hit" and f"cached in {store.uri}" in p.reason for p in t.plan(*args).values())
        assert t.run(*args) == []
        local_b = run_dir / "artifacts" / "toy_b" / keys["toy_b"]
        assert (local_b / "b.txt").read_text().endswith("+b") and (local_b / "manifest.json").is_file()

        # The bucket lost an artifact (a push cut short): the next run pushes it again, runs nothing.
        store.delete_dir(f"artifacts/toy_c/{keys['toy_c']}")
        assert t.run(*args) == []
        assert remote("toy_c", keys["toy_c"])[0] is not None

        # Files in the bucket without their manifest are not an artifact: the stage runs again.
        store.delete(f"artifacts/toy_c/{keys['toy_c']}/manifest.json")
        shutil.rmtree(run_dir / "artifacts" / "toy_c")
        assert t.plan(*args)["toy_c"].status == "miss"
        assert t.run(*args) == ["c"]
        assert remote("toy_c", keys["toy_c"])[0] is not None


def test_force_reruns_from_scratch_and_a_failed_rerun_keeps_the_last_good_artifact(toy):
    t, _, _, run_dir = toy
    t.run()
    key = t.plan()["toy_a"].key
    out = storage.artifact_dir(run_dir, "toy_a", key)
    assert (out / "started_at_step.txt").read_text() == "0"
    assert t.run(force=["toy_a"]) == ["a"]
    assert (out / "started_at_step.txt").read_text() == "0"  # its checkpoints were cleared: not resumed

    (run_dir / "FAIL_A").write_text("")
    before = storage.ArtifactStore(run_dir).manifest("toy_a", key)
    with pytest.raises(RuntimeError, match="boom"):
        t.run(force=["toy_a"])
    assert storage.ArtifactStore(run_dir).manifest("toy_a", key) == before  # the last good result is untouched
    assert (out / "a.txt").read_text() == "64"
    assert t.plan()["toy_a"].status == "hit"
    (run_dir / "FAIL_A").unlink()
    assert t.run() == []


def test_a_truncated_or_missing_output_is_a_miss_not_a_hit(toy):
    t, _, _, run_dir = toy
    t.run()
    out = storage.artifact_dir(run_dir, "toy_a", t.plan()["toy_a"].key)
    (out / "a.txt").write_text("6")  # truncated after it was made
    plan = t.plan()
    assert plan["toy_a"].status == "miss" and \
        plan["toy_a"].reason == "output damaged: a.txt has 1 bytes, 2 when it was made"
    assert plan["toy_b"].status == "hit"  # the same key upstream: only the damaged stage reruns
    assert t.run() == ["a"] and (out / "a.txt").read_text() == "64"
    (out / "a.txt").write_text("65")  # the same size, other content
    assert "a.txt changed after it was made" in t.plan()["toy_a"].reason
    (out / "a.txt").unlink()
    assert t.plan()["toy_a"].reason == "output damaged: a.txt is missing"


def test_a_custom_rule_reward_module_is_part_of_the_ppo_key(tmp_path, monkeypatch):
    """`rewards.rule: module:function` is code ppo imports by a configured name: editing it reruns ppo."""
    code = tmp_path / "code"
    code.mkdir()
    (code / "my_reward.py").write_text("def score(prompt, response, answer):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(code))

    def plan():
        return {p.spec.name: p
                for p in build_plan(smoke_config(tmp_path / "run", "stages.ppo.rewards.rule=my_reward:score"))}

    before = plan()
    assert any(path.endswith("my_reward.py") for path in before["ppo"].components["code"])
    (code / "my_reward.py").write_text("def score(prompt, response, answer):\n    return 0.0\n")
    after = plan()
    assert after["ppo"].key != before["ppo"].key
    assert [after[n].key for n in ("model", "data", "sft", "reward")] == \
        [before[n].key for n in ("model", "data", "sft", "reward")]


def test_a_stage_is_keyed_on_its_own_code_so_editing_another_stage_keeps_it_cached(tmp_path, monkeypatch):
    """An edit to PPO's code (simulated: its files hash differently) changes the ppo key (and
    serve's, downstream) but not the sweep's or the stages before it. Imports made only for type
    annotations (`if TYPE_CHECKING:`) used to pull every stage into every key through the config."""
    from pipeline import artifacts as arts

    sweep = ["stages.tune.target=sft", "stages.tune.search_space.lr.grid=[0.001, 0.01]"]

    def keys():
        return {p.spec.name: p.key for p in build_plan(smoke_config(tmp_path / "run", *sweep))}

    before = keys()
    real = arts.sha256_file
    monkeypatch.setattr(arts, "sha256_file", lambda p: "edited" if "stages/ppo/" in str(p) else real(p))
    after = keys()
    assert after["ppo"] != before["ppo"] and after["serve"] != before["serve"]
    for name in ("model", "data", "sft", "reward", "tune"):
        assert after[name] == before[name], name


def test_the_serve_key_includes_the_registry_it_registers_in(tmp_path):
    def keys(uri):
        return {p.spec.name: p.key for p in build_plan(smoke_config(tmp_path / "run", f"mlflow.tracking_uri={uri}"))}

    a, b = keys(f"sqlite:///{tmp_path / 'a.db'}"), keys(f"sqlite:///{tmp_path / 'b.db'}")
    assert a["serve"] != b["serve"]
    assert all(a[n] == b[n] for n in ("model", "data", "sft", "reward", "ppo"))


# --------------------------------------------------------------------------- the bucket under faults


@pytest.fixture
def bucket_toy(toy):
    from helpers.s3 import S3Server

    t, _, _, run_dir = toy
    with S3Server() as s3:
        yield t, run_dir, s3.store("toy"), (f"storage.uri=s3://{s3.bucket}/toy", f"storage.endpoint_url={s3.endpoint}")


def _bucket_file(bucket, stage: str, key: str, name: str) -> str:
    import json

    return (f"artifacts/{stage}/{key}/"
            f"{json.loads(bucket.read_bytes(f'artifacts/{stage}/{key}/manifest.json'))['copy']}/{name}")


def test_a_forced_rerun_over_a_bucket_only_artifact_replaces_same_size_stale_bytes(bucket_toy, tmp_path):
    """This machine's run_dir lacks the artifact, the bucket holds it with its large file changed at the
    same size: `--force` rebuilds it and the bucket ends with the rebuilt bytes, which another empty
    run_dir pulls."""
    import shutil

    t, run_dir, bucket, args = bucket_toy
    assert t.run(*args) == ["a", "b", "c"]
    key = t.plan(*args)["toy_c"].key
    shutil.rmtree(run_dir / "artifacts")
    rel = _bucket_file(bucket, "toy_c", key, "weights.bin")
    bucket.write_bytes(rel, bytes(255 - c for c in WEIGHTS))  # stale weights, same size
    assert t.run(*args, only=["toy_c"], force=["toy_c"]) == ["c"]
    assert bucket.read_bytes(_bucket_file(bucket, "toy_c", key, "weights.bin")) == WEIGHTS
    other = storage.ArtifactStore(tmp_path / "other", bucket)
    assert other.pull("toy_c", key) is not None
    assert (other.local_dir("toy_c", key) / "weights.bin").read_bytes() == WEIGHTS


def test_a_damaged_bucket_artifact_is_a_miss_named_in_the_plan_and_rebuilt(bucket_toy):
    """A large file changed at the same size, then a small file truncated: each time the plan names the
    damage, the run rebuilds the stage (no traceback) and the bucket holds a good copy again."""
    import shutil

    t, run_dir, bucket, args = bucket_toy
    assert t.run(*args) == ["a", "b", "c"]
    key = t.plan(*args)["toy_c"].key
    for name, data in (("weights.bin", bytes(255 - c for c in WEIGHTS)), ("c.txt", b"")):
        shutil.rmtree(run_dir / "artifacts" / "toy_c")
        bucket.write_bytes(_bucket_file(bucket, "toy_c", key, name), data)
        plan = t.plan(*args)["toy_c"]
        assert plan.status == "miss" and f"damaged in {bucket.uri}: {name}" in plan.reason, plan.reason
        assert t.run(*args) == ["c"]
        assert storage.ArtifactStore(run_dir, bucket).remote("toy_c", key)[0] is not None
        assert bucket.read_bytes(_bucket_file(bucket, "toy_c", key, "weights.bin")) == WEIGHTS


def test_a_commit_cut_off_mid_upload_leaves_the_previous_copy_pullable(bucket_toy, tmp_path, monkeypatch):
    from pipeline.bucket import ObjectStore
    from pipeline.errors import StorageError

    t, run_dir, bucket, args = bucket_toy
    assert t.run(*args) == ["a", "b", "c"]
    key = t.plan(*args)["toy_c"].key
    before = storage.ArtifactStore(run_dir).manifest("toy_c", key)
    real, calls = ObjectStore.upload_file, []

    def flaky(self, local, rel, sha256=None):
        calls.append(rel)
        if len(calls) == 2:
            raise StorageError(f"cannot upload {local} to {self.url(rel)}: connection reset")
        return real(self, local, rel, sha256)

    monkeypatch.setattr(ObjectStore, "upload_file", flaky)
    with pytest.raises(StorageError, match="connection reset"):
        t.run(*args, only=["toy_c"], force=["toy_c"])
    monkeypatch.undo()
    assert storage.ArtifactStore(run_dir).manifest("toy_c", key) == before  # here: the last good copy
    fresh = storage.ArtifactStore(tmp_path / "fresh", bucket)  # and in the bucket, whole
    assert fresh.lookup("toy_c", key).where == "bucket" and fresh.pull("toy_c", key)["copy"] == before["copy"]
    assert (fresh.local_dir("toy_c", key) / "weights.bin").read_bytes() == WEIGHTS
    assert t.run(*args, only=["toy_c"], force=["toy_c"]) == ["c"]  # the next commit clears the orphaned upload
    assert {n.split("/")[0] for n in bucket.files(f"artifacts/toy_c/{key}")} == {
        storage.ArtifactStore(run_dir).manifest("toy_c", key)["copy"], "manifest.json"}


def test_a_staged_serve_rerun_tags_its_registered_model_with_the_cache_key(tmp_path, tracking_uri):
    """serve builds in the store's staging directory; the key it tags is the key, not the directory's name."""
    from mlflow.tracking import MlflowClient

    code = tmp_path / "code"
    code.mkdir()
    (code / "toy_policy.py").write_text(textwrap.dedent('''
        def run(cfg, ctx):
            (ctx.out_dir / "model").mkdir()
            (ctx.out_dir / "model" / "config.json").write_text("{}")
            return {"policy_model": ctx.out_dir / "model"}
    '''))
    sys.path.insert(0, str(code))
    registry = (StageSpec("toy_policy", "toy_policy", "model", (), (), ("policy_model",), "p"),
                next(s for s in __import__("pipeline.registry").registry.STAGES if s.name == "serve"))
    name = f"toy-{tmp_path.name}"
    try:
        cfg = smoke_config(tmp_path / "run", f"mlflow.tracking_uri={tracking_uri}", "stages.serve.deploy=false",
                           f"stages.serve.registry.model_name={name}")
        run_pipeline(cfg, SMOKE, Console(quiet=True), registry=registry)
        client = MlflowClient(tracking_uri)
        client.delete_registered_model(name)  # the registry lost it: the rerun registers a new version
        summary = run_pipeline(cfg, SMOKE, Console(quiet=True), registry=registry, force=["serve"])
        key = summary["stages"]["serve"]["key"]
        version = client.get_model_version_by_alias(name, cfg.stages.serve.registry.alias)
        assert version.tags["serve_cache_key"] == key
    finally:
        sys.path.remove(str(code))
        sys.modules.pop("toy_policy", None)
