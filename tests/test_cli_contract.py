"""The command line's contract, command by command (issue 59, item 3): each failure path exits with the code the
CLI documents (`python -m pipeline --help`: 2 for a usage or configuration error), says what is wrong and the
fix, shows no traceback, and writes nothing. Every command the parser has must have a row here, so a new
command brings its failure paths with it.

Each case runs `main(argv)` in this process (`conftest.cli_in_process`): no process behaviour is under test."""

from __future__ import annotations

import socket

import pytest

from conftest import SMOKE, cli_in_process

# The costly starts this module makes (tests/helpers/starts.py): `run --only data` plans, finds the model stage's
# output missing and stops before any stage.
STARTS = {"pipelines": 1}

# (command, arguments after it ({run} is a run_dir that must stay absent, {store} a run with an empty store,
# {port} a port something listens on), exit code, what the message says)
CASES = [
    ("validate", ["{config}", "run_dir={run}", "stages.sft.lrr=1"], 2, "did you mean 'lr'?"),
    ("validate", ["{missing}"], 2, "no-such.yaml"),
    ("validate", ["{duplicate}"], 2, "appears twice"),
    ("plan", ["{config}", "run_dir={run}", "--only", "sfft"], 2, "unknown stage 'sfft'; did you mean 'sft'?"),
    ("plan", ["{config}", "run_dir={run}", "--from", "ppo", "--to", "sft"], 2, "selects no stage"),
    ("run", ["{config}", "run_dir={run}", "--from", "ppo", "--to", "sft"], 2, "--from ppo --to sft selects no stage"),
    ("run", ["{config}", "run_dir={run}", "--froms", "sft"], 2, "did you mean --from?"),
    ("run", ["{config}", "run_dir={run}", "--force", "sfft"], 2, "did you mean 'sft'?"),
    ("run", ["{config}", "run_dir={run}", "--only", "data"], 2, "needs the output of stage 'model'"),
    ("submit", ["{config}", "run_dir={run}", "--deadline", "5"], 2, "--deadline SECONDS needs --wait"),
    ("status", ["pipeline-x", "--address", "http://127.0.0.1:9"], 2, "no Ray dashboard answers there"),
    ("logs", ["pipeline-x", "--address", "http://127.0.0.1:9"], 2, "no Ray dashboard answers there"),
    ("stop", ["pipeline-x", "--address", "http://127.0.0.1:9"], 2, "no Ray dashboard answers there"),
    ("ui", ["{config}", "run_dir={run}"], 2, "ui: no run has tracked to "),
    ("ui", ["run_dir={run}"], 2, "ui: no run has tracked to "),
    ("ui", ["{config}", "run_dir={store}", "--port", "{port}"], 2, "--port: cannot bind 127.0.0.1:{port}"),
    ("serve", ["run_dir={run}"], 2, "no run has tracked to "),
    ("serve", ["{config}", "run_dir={run}", "--model", "{missing}"], 2, "not a model directory"),
    ("batch-infer", ["{config}", "run_dir={run}", "--prompts", "{config}"], 2,
     "--prompts: smoke.yaml: unsupported format"),
    ("batch-infer", ["{config}", "run_dir={run}", "--prompts", "{prompts}"], 2, "no run has tracked to "),
    ("compare", ["{run}", "{run}:sft"], 2, "not found; give a run directory"),
    ("compare", ["{store}:rewrd", "{store}"], 2, "'rewrd' is not a policy stage"),
]


def _commands() -> set[str]:
    from pipeline.__main__ import _parser, commands

    return set(commands(_parser()))


def test_every_command_has_its_failure_paths_here():
    assert _commands() == {command for command, *_ in CASES}


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A run directory with a tracking store and nothing in it."""
    from mlflow.tracking import MlflowClient

    store = tmp_path_factory.mktemp("store")
    MlflowClient(f"sqlite:///{store / 'mlflow.db'}").search_experiments()
    (store / "artifacts").mkdir()
    return store


@pytest.fixture(scope="module")
def listening():
    """A port something listens on (another MLflow UI, another server)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.mark.parametrize("command, args, code, says", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_a_failure_exits_with_its_code_names_the_fix_and_writes_nothing(tmp_path, capfd, store, listening, command,
                                                                        args, code, says):
    duplicate = tmp_path / "duplicate.yaml"
    duplicate.write_text(SMOKE.read_text().replace("seed: 0", "seed: 0\nseed: 1", 1))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "1+1"}\n')
    names = {"config": SMOKE, "run": tmp_path / "run", "store": store, "port": listening, "duplicate": duplicate,
             "missing": tmp_path / "no-such.yaml", "prompts": prompts}
    def files():
        return sorted(p for d in (tmp_path, store) for p in d.rglob("*")), (store / "mlflow.db").read_bytes()

    before = files()

    result = cli_in_process(capfd, command, *[a.format(**names) for a in args])

    output = result.stdout + result.stderr
    assert result.returncode == code, output[-3000:]
    assert says.format(**names) in output, output[-3000:]
    assert "Traceback" not in output
    assert files() == before  # nothing written
