"""Configuration: shipped YAMLs validate, user mistakes give one clear message and exit 2."""

from __future__ import annotations

import pytest
from pydantic import BaseModel

from conftest import ROOT, SMOKE, cli_in_process, smoke_config
from pipeline.config import PipelineConfig, _read_yaml, load_config, parse_override, reference, subsection
from pipeline.errors import ConfigError


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("**/*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_validates(path):
    cfg = load_config(path)
    assert cfg.run_dir.is_absolute()


def test_default_takes_the_rlhf_path():
    """`make run` is the RLHF the pipeline is named for: a gold preference labels the pairs (with human-like
    noise) and judges RL; PPO's reward includes the learned reward model (so the reward role is started),
    mixed with the verifier as bench/rlhf_mix.json chose; the verifier-only default lives on as a recipe."""
    cfg = load_config(ROOT / "configs" / "full.yaml")
    assert cfg.task.preference.gold == "explained" and 0.1 <= cfg.task.preference.noise <= 0.2
    ppo = cfg.stages.ppo
    assert ppo.rewards.model_weight > 0 and ppo.rewards.rule_weight > 0 and ppo.rewards.normalize
    # the reward model is loaded: in the colocated layout inside each policy rank (no CPUs of its own), in the
    # separate one on ranks of its own
    assert ppo.layout == "colocated" and ppo.cpus_needed() == ppo.policy.num_ranks * ppo.policy.cpus_per_rank
    separate = ppo.model_copy(update={"layout": "separate"})
    without_rm = separate.model_copy(update={"rewards": ppo.rewards.model_copy(update={"model_weight": 0.0})})
    assert separate.cpus_needed() - without_rm.cpus_needed() == ppo.reward.num_ranks * ppo.reward.cpus_per_rank > 0
    assert ppo.eval_every, "the over-optimisation curve (gold, proxy, KL) is logged during the run"
    verifier = load_config(ROOT / "configs" / "recipes" / "verifier.yaml")
    assert not verifier.task.preference.gold and verifier.stages.ppo.rewards.model_weight == 0


def test_every_option_is_documented():
    missing = [key for key, _, desc in reference() if not desc.strip()]
    assert not missing, f"fields without a description: {missing}"


def test_config_reference_is_current():
    import subprocess
    import sys

    rc = subprocess.run([sys.executable, "scripts/config_docs.py", "--check"], cwd=ROOT).returncode
    assert rc == 0, "docs/configuration.md (the config reference) is stale: run scripts/config_docs.py"


def test_override_sets_nested_values(tmp_path):
    cfg = smoke_config(tmp_path, "stages.data.max_len=96", "task.ops=['+', '*']", "stages.data.pack=true")
    assert cfg.stages.data.max_len == 96
    assert cfg.task.ops == ["+", "*"]
    assert cfg.stages.data.pack is True


@pytest.mark.parametrize(
    "override, expected",
    [
        ("stages.data.maxlen=3", "stages.data.maxlen: unknown key; did you mean 'max_len'?"),
        ("stages.data.max_len=abc", "stages.data.max_len: input should be a valid integer"),
        ("stages.data.max_len=-1", "stages.data.max_len: input should be greater than or equal to 8, got -1"),
        ("stages.data.on_bad_rows=skip", "stages.data.on_bad_rows: input should be 'drop' or 'fail'"),
        ("task.max_digits=0", "task.max_digits: input should be greater than or equal to 1"),
        ("model.builtin.num_heads=3", "num_heads (3) must divide hidden_size (64)"),
        ("stages.data.sources.sft=[/nonexistent/rows.jsonl]",
         "stages.data.sources.sft.0.path: not found: /nonexistent/rows.jsonl"),
        ("stages.data.sources.prompts=[{path: bench/rlhf_mix.json, format: alpaca}]",
         "stages.data.sources.prompts[0].format: 'alpaca' is not a prompts format"),
        ("model.source=/nonexistent/ckpt", "model.source: model directory not found: /nonexistent/ckpt"),
        ("stages.data.max_len", "expected key.path=value"),
    ],
)
def test_user_mistakes_name_the_key(tmp_path, override, expected):
    with pytest.raises(ConfigError) as exc:
        smoke_config(tmp_path, override)
    assert expected in str(exc.value)


def test_invalid_yaml_names_the_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("run_dir: x\nstages:\n  data: [unclosed\n")
    with pytest.raises(ConfigError, match=r"invalid YAML at line \d+"):
        load_config(bad)


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")


def test_cli_user_error_exits_2_without_traceback_and_writes_nothing(tmp_path, capfd):
    run_dir = tmp_path / "run"
    result = cli_in_process(capfd, "run", str(SMOKE), f"run_dir={run_dir}", "stages.data.max_len=-5")
    assert result.returncode == 2
    assert "stages.data.max_len" in result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    assert not run_dir.exists()


def test_a_mistyped_command_names_the_closest_one(capfd):
    result = cli_in_process(capfd, "rnu", str(SMOKE))
    assert result.returncode == 2 and "unknown command 'rnu'; did you mean 'run'?" in result.stderr


def test_cli_unknown_stage_exits_2(tmp_path, capfd):
    result = cli_in_process(capfd, "plan", str(SMOKE), f"run_dir={tmp_path}", "--only", "sftt")
    assert result.returncode == 2
    assert "unknown stage 'sftt'" in result.stderr and "model, data" in result.stderr


def test_validate_and_plan_import_no_heavy_packages(tmp_path):
    import subprocess
    import sys

    code = (
        "import sys; from pipeline.__main__ import main; "
        f"main(['validate', {str(SMOKE)!r}, 'run_dir={tmp_path}']); "
        f"main(['plan', {str(SMOKE)!r}, 'run_dir={tmp_path}']); "
        "print('HEAVY', sorted(m for m in ('ray', 'vllm', 'deepspeed', 'torch', 'mlflow', 'transformers') if m in "
        "sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120).stdout
    assert "HEAVY []" in out, out
    assert "never run" in out  # the plan explains each miss
    assert not (tmp_path / "artifacts").exists()


def test_all_sections_reject_unknown_keys():
    def walk(model: type[BaseModel]):
        assert model.model_config.get("extra") == "forbid", model
        for f in model.model_fields.values():
            sub, _ = subsection(f.annotation)  # X, X | None, dict[str, X]
            if sub is not None:
                walk(sub)

    walk(PipelineConfig)


def test_flags_and_overrides_mix_in_any_order(tmp_path, capfd):
    result = cli_in_process(capfd, "plan", str(SMOKE), "--only", "model,data", f"run_dir={tmp_path}",
                            "stages.data.max_len=70")
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("miss") == 2
    bad = cli_in_process(capfd, "plan", str(SMOKE), "--only", "model", "stray")
    assert bad.returncode == 2 and "unrecognized arguments: stray" in bad.stderr


def test_cross_field_and_encoding_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"max_len \(1000\) exceeds model.builtin.max_position_embeddings \(128\)"):
        smoke_config(tmp_path, "stages.data.max_len=1000")
    with pytest.raises(ConfigError, match="no data"):
        smoke_config(tmp_path, "stages.data.generate={sft: 0, preference: 0, prompts: 0}")
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"\xff\xfe\x00run_dir")
    with pytest.raises(ConfigError, match="not a UTF-8 text file"):
        load_config(binary)


def test_unreachable_tracking_server_is_a_user_error(tmp_path, capfd):
    result = cli_in_process(capfd, "run", str(SMOKE), f"run_dir={tmp_path / 'run'}", "mlflow.tracking_uri=http://127.0.0.1:1")
    assert result.returncode == 2 and "mlflow.tracking_uri: cannot reach" in result.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("overrides, graph, ppo_reads", [
    ((), "model data sft reward ppo serve", ("sft_model", "reward_model", "prompt_data")),
    (("stages.reward=null", "stages.ppo.algorithm=grpo", "stages.ppo.rewards.model_weight=0"),
     "model data sft ppo serve", ("sft_model", "prompt_data")),
    (("stages.reward=null", "stages.ppo.rewards.model_weight=0"),  # PPO's critic starts from the SFT model
     "model data sft ppo serve", ("sft_model", "prompt_data")),
    (("stages.ppo=null",), "model data sft reward serve", None),
    (("stages.sft=null", "stages.reward.init_from=base"), "model data reward ppo serve",
     ("base_model", "reward_model", "prompt_data")),
    (("stages.sft=null", "stages.reward=null", "stages.ppo=null"), "model data serve", None),
])
def test_the_stage_graph_follows_the_config(tmp_path, overrides, graph, ppo_reads):
    from pipeline.registry import stages_for

    specs = {s.name: s for s in stages_for(smoke_config(tmp_path, *overrides))}
    assert " ".join(specs) == graph
    assert (specs["ppo"].inputs if "ppo" in specs else None) == ppo_reads
    last = "policy_model" if "ppo" in specs else "sft_model" if "sft" in specs else "base_model"
    assert specs["serve"].inputs == (last,)  # serve takes the last model trained unless told otherwise


def test_serve_can_be_dropped_like_any_stage(tmp_path, capsys):
    """`stages.serve: null` is a pipeline that registers and serves nothing: it validates, its plan has no serve
    stage, and the serve and batch-infer commands still find a default registered model."""
    from pipeline.__main__ import main
    from pipeline.registry import stages_for
    from stages.serve.command import default_model

    cfg = smoke_config(tmp_path, "stages.serve=null")
    assert cfg.stages.serve is None
    assert [s.name for s in stages_for(cfg)] == ["model", "data", "sft", "reward", "ppo"]
    assert default_model(cfg) == "models:/posttrain-policy@champion"
    assert main(["plan", str(SMOKE), f"run_dir={tmp_path}", "stages.serve=null"]) == 0
    out = capsys.readouterr().out
    assert "graph: model -> data -> sft -> reward -> ppo\n" in out and "serve" not in out, out
    assert not (tmp_path / "artifacts").exists()


@pytest.mark.parametrize("overrides, message", [
    (("stages.reward=null",), "stages.ppo.rewards.model_weight is 0.5 but stages.reward is null: there is no reward "
                              "model to score with; set stages.ppo.rewards.model_weight: 0"),
    (("stages.sft=null",), "stages.reward.init_from is sft but stages.sft is null; set stages.reward.init_from: base"),
    (("stages.ppo=null", "stages.serve.source=policy_model"),
     "stages.serve.source is policy_model but stages.ppo is null; use one of base_model, sft_model"),
    (("stages.tune={target: reward, search_space: {lr: {choice: [0.001]}}}", "stages.reward=null",
      "stages.ppo.rewards.model_weight=0"), "stages.tune.target is reward but stages.reward is null"),
])
def test_graphs_that_cannot_work_are_refused_naming_the_key(tmp_path, overrides, message, capfd):
    result = cli_in_process(capfd, "validate", str(SMOKE), f"run_dir={tmp_path}", *overrides)
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert not (tmp_path / "artifacts").exists()


def test_a_typo_in_an_optional_section_is_answered_with_its_keys(tmp_path):
    """Most stages' sections are optional (`X | None`): a typo there names the close key and the valid ones
    (it named none before: the search for the owning class stopped at the union)."""
    with pytest.raises(ConfigError) as err:
        smoke_config(tmp_path, "stages.sft.lrr=0.1")
    assert "stages.sft.lrr: unknown key; did you mean 'lr'? valid keys here: " in str(err.value)
    assert "micro_batch_size" in str(err.value)
    with pytest.raises(ConfigError, match=r"stages\.ppo\.distill\.wieght: unknown key; did you mean 'weight'\?"):
        smoke_config(tmp_path, "stages.ppo.distill.wieght=1")


def test_a_duplicate_key_is_refused_naming_both_lines(tmp_path, capfd):
    """PyYAML keeps the last of two equal keys silently: `lr` given twice ran with the second value and no
    word. It is a config error (exit 2) naming the key, its section and both lines; a merge key (`<<`) that
    a later key overrides is not a duplicate."""
    config = tmp_path / "dup.yaml"
    config.write_text(f"run_dir: {tmp_path / 'run'}\nstages:\n  sft:\n    lr: 0.001\n    epochs: 1\n    lr: 0.002\n")
    with pytest.raises(ConfigError) as exc:
        load_config(config)
    assert str(exc.value) == f"{config}: key 'lr' appears twice in stages.sft (lines 4 and 6); keep one"
    result = cli_in_process(capfd, "validate", str(config))
    assert result.returncode == 2 and "key 'lr' appears twice in stages.sft (lines 4 and 6)" in result.stderr
    assert not (tmp_path / "run").exists()
    top = tmp_path / "top.yaml"
    top.write_text("seed: 1\nrun_dir: x\nseed: 2\n")
    with pytest.raises(ConfigError, match=r"key 'seed' appears twice at the top level \(lines 1 and 3\)"):
        load_config(top)
    with pytest.raises(ConfigError, match=r"override .*: key 'a' appears twice in stages\.x; keep one"):
        parse_override("stages.x={a: 1, a: 2}")
    merged = tmp_path / "merged.yaml"
    merged.write_text("base: &b {lr: 0.001, epochs: 1}\nsft:\n  <<: *b\n  lr: 0.002\n")
    assert _read_yaml(merged)["sft"] == {"lr": 0.002, "epochs": 1}


@pytest.mark.parametrize("statuses, line", [(("miss", "hit"), "done: 1 stage run, 1 cached;"),
                                            (("miss", "miss"), "done: 2 stages run, 0 cached;")])
def test_the_closing_line_counts_in_words(tmp_path, capfd, monkeypatch, statuses, line):
    """`run`'s last line said "1 stages run" (issue 59): the run itself is stubbed, only the wording is under test."""
    from types import SimpleNamespace

    from pipeline import __main__ as cli, runner, tracking

    monkeypatch.setattr(tracking, "check_reachable", lambda uri: None)
    monkeypatch.setattr(cli, "print_outcomes", lambda *a, **k: None)
    monkeypatch.setattr(runner, "run_pipeline", lambda *a, **k: {
        "plan": [SimpleNamespace(status=s) for s in statuses], "started_ray": False})
    result = cli_in_process(capfd, "run", str(SMOKE), f"run_dir={tmp_path}")
    assert result.returncode == 0, result.stderr
    assert line in result.stdout, result.stdout
