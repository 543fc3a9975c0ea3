"""The console: our lines and progress reach the person, library output goes to the stage's log file."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from conftest import ROOT
from pipeline.console import MARK, Board, parse, progress_line, rate_eta


def test_rate_and_eta_count_from_the_first_report():
    assert rate_eta((100.0, 0), 100.0, 0, 10) == (None, None)  # nothing measurable yet
    rate, eta = rate_eta((100.0, 2), 104.0, 6, 10)  # 4 steps in 4 s, 4 to go
    assert (rate, eta) == (1.0, 4.0)
    assert rate_eta((100.0, 0), 110.0, 5, None) == (0.5, None)  # unknown total: a rate, no ETA


def test_a_plain_progress_line_has_count_rate_eta_and_note():
    assert progress_line("sft", "step", 6, 12, 2.0, 3.0, "loss 2.31") == "sft: step 6/12 (50%), 2 step/s, ETA 3s, loss 2.31"
    assert progress_line("ppo", "iter", 1, 3, 0.05, 40.0) == "ppo: iter 1/3 (33%), 20 s/iter, ETA 40s"
    assert progress_line("data: tokenize", "row", 64, None, None, None) == "data: tokenize: 64 rows"
    assert "ETA" not in progress_line("sft", "step", 12, 12, 2.0, 0.0)  # finished


def test_off_a_terminal_progress_is_the_first_the_last_and_periodic_lines():
    from rich.console import Console
    import io

    out = io.StringIO()
    board = Board(Console(file=out, force_terminal=False, width=200), live=False)
    for step in range(0, 13):
        board.update({"task": "sft", "done": step, "total": 12, "unit": "step", "note": ""})
    for rows in (64, 64, 64):
        board.update({"task": "data: tokenize", "by": rows, "total": 192, "unit": "row"})
    lines = out.getvalue().splitlines()
    assert [line.split(" ", 3)[-1].split(",")[0] for line in lines] == [
        "sft: step 0/12 (0%)", "sft: step 12/12 (100%)", "data: tokenize: row 64/192 (33%)",
        "data: tokenize: row 192/192 (100%)"]


def test_worker_events_are_marked_lines_and_anything_else_is_a_library_line():
    assert parse(MARK + '{"line": "sft: ready"}') == {"line": "sft: ready"}
    assert parse("(RayTrainWorker pid=3) " + MARK + '{"task": "sft", "done": 1}') == {"task": "sft", "done": 1}
    assert parse("INFO some library line") is None
    assert parse(MARK + "not json") is None


ROUTED = textwrap.dedent(r'''
    import logging, os, subprocess, sys
    from pathlib import Path
    from rich.console import Console
    from pipeline.console import MARK, Router, advance, install, say

    router = Router(verbose=len(sys.argv) > 2)
    router.console = Console(file=router.out, highlight=False, soft_wrap=True)
    install(router)
    with router.capture(Path(sys.argv[1])):
        print("outside any stage")
        with router.stage("sft") as log:
            print("a library print")
            os.write(2, b"a C library's stderr\n")
            logging.getLogger("ray.core").warning("a library warning")
            logging.getLogger("vllm").error("EngineDeadError: the engine died")
            subprocess.run(["sh", "-c", "echo a child process line"])
            say("sft: one of our lines")
            for step in range(5):
                advance("sft", step, 4, "step", "loss 1.0")
            router._ray_batch({"pid": 7, "actor_name": "RayTrainWorker", "ip": "a", "localhost": "a",
                               "lines": ["a worker's library line", MARK + '{"line": "sft: a worker line"}']})
        router.console.print("summary")
    print("stdout is back")
''')


def _routed(tmp_path, *extra):
    script = tmp_path / "routed.py"
    script.write_text(ROUTED)
    result = subprocess.run([sys.executable, str(script), str(tmp_path / "run"), *extra], capture_output=True,
                            text=True, cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, timeout=60)
    assert result.returncode == 0, result.stderr
    return result, (tmp_path / "run" / "logs" / "sft.log").read_text()


LIBRARY = ["a library print", "a C library's stderr", "a library warning", "a child process line",
           "(RayTrainWorker pid=7) a worker's library line"]


def test_library_output_goes_to_the_stage_log_and_only_ours_reaches_the_console(tmp_path):
    result, log = _routed(tmp_path)
    console = result.stdout + result.stderr
    for line in LIBRARY:
        assert line in log and line not in console, line
    assert "outside any stage" in (tmp_path / "run" / "logs" / "run.log").read_text()
    for ours in ("sft: one of our lines", "sft: a worker line", "sft: step 0/4", "sft: step 4/4", "summary",
                 "stdout is back"):
        assert ours in console, ours
    # An error that matters reaches the console as one line naming the log file.
    notices = [line for line in console.splitlines() if "EngineDeadError" in line]
    assert len(notices) == 1 and "logs/sft.log" in notices[0]
    assert "sft: step 1/4" not in console  # off a terminal: first, last and periodic lines only


def test_verbose_shows_library_output_live_and_still_logs_it(tmp_path):
    result, log = _routed(tmp_path, "--verbose")
    for line in LIBRARY:
        assert line in log and line in result.stderr, line


def test_on_a_terminal_progress_is_a_live_bar_with_rate_and_eta(monkeypatch):
    import io

    from rich.console import Console

    from pipeline import console

    clock = iter([1000.0, 1003.0])  # the two reports, three seconds apart
    monkeypatch.setattr(console.time, "time", lambda: next(clock, 1003.0))
    out = io.StringIO()
    board = Board(Console(file=out, force_terminal=True, width=160), live=None)  # decides by the console
    assert board.live
    board.update({"task": "sft", "done": 0, "total": 12, "unit": "step", "note": ""})
    board.update({"task": "sft", "done": 6, "total": 12, "unit": "step", "note": "loss 2.31"})
    board.stop()
    shown = out.getvalue()
    assert "━" in shown and "step 6/12 (50%), 2 step/s, ETA 3s, loss 2.31" in shown
