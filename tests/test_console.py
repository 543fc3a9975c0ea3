"""The console: our lines and progress reach the person, library output goes to the stage's log file."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap

import pytest

from conftest import ROOT
from pipeline.progress import Board, progress_line, rate_eta
from pipeline.events import MARK, parse


def test_rate_and_eta_count_from_the_first_report():
    assert rate_eta((100.0, 0), 100.0, 0, 10) == (None, None)  # nothing measurable yet
    rate, eta = rate_eta((100.0, 2), 104.0, 6, 10)  # 4 steps in 4 s, 4 to go
    assert (rate, eta) == (1.0, 4.0)
    assert rate_eta((100.0, 0), 110.0, 5, None) == (0.5, None)  # unknown total: a rate, no ETA


def test_a_plain_progress_line_has_count_rate_eta_and_note():
    assert progress_line("sft", "step", 6, 12, 2.0, 3.0, "loss 2.31") == \
        "sft: step 6/12 (50%), 2 step/s, ETA 3s, loss 2.31"
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
    from pipeline.console import Router, install
    from pipeline.events import MARK, advance, say

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

    import time

    clock = iter([1000.0, 1003.0])  # the two reports, three seconds apart
    monkeypatch.setattr(time, "time", lambda: next(clock, 1003.0))
    out = io.StringIO()
    board = Board(Console(file=out, force_terminal=True, width=160), live=None)  # decides by the console
    assert board.live
    board.update({"task": "sft", "done": 0, "total": 12, "unit": "step", "note": ""})
    board.update({"task": "sft", "done": 6, "total": 12, "unit": "step", "note": "loss 2.31"})
    board.stop()
    shown = out.getvalue()
    assert "━" in shown and "step 6/12 (50%), 2 step/s, ETA 3s, loss 2.31" in shown


# --------------------------------------------------------------------------- the console never blocks or fails the run

SCRIPT = textwrap.dedent(r'''
    import builtins, errno, json, logging, os, resource, signal, subprocess, sys, time
    from pathlib import Path

    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # the crash tests leave no core file behind
    if "console-gone" in sys.argv:  # fds 1 and 2 are a pipe nobody reads any more
        r, w = os.pipe()
        os.close(r)
        os.dup2(w, 1)
        os.dup2(w, 2)
        os.close(w)

    from rich.console import Console
    from pipeline.console import Router, install
    from pipeline.events import MARK, advance, say

    run_dir = Path(sys.argv[1])
    router = Router()
    router.console = Console(file=router.out, highlight=False, soft_wrap=True, force_terminal="live" in sys.argv)
    install(router)


    def log_files_fail(how, name=".log"):
        """Opening a log file (under logs/, its name ending `name`) gives /dev/full (how="full") or
        fails with EROFS; both `os.open` and `open` are patched, whichever the router uses."""
        real_os_open, real_open = os.open, builtins.open

        def hit(path):
            return isinstance(path, (str, os.PathLike)) and "/logs/" in str(path) and str(path).endswith(name)

        def fake_os_open(path, flags, mode=0o777, **kw):
            if not hit(path):
                return real_os_open(path, flags, mode, **kw)
            if how == "full":
                return real_os_open("/dev/full", os.O_WRONLY)
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))

        def fake_open(file, mode="r", *args, **kw):
            if not hit(file):
                return real_open(file, mode, *args, **kw)
            if how == "full":
                return real_open("/dev/full", mode.replace("a", "w"), *args, **kw)
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(file))

        os.open, builtins.open = fake_os_open, fake_open
''')


def _script(tmp_path, body: str, *args, timeout: float = 90):
    """Run SCRIPT + `body` in its own process (the router takes over its fds 1 and 2). A run that
    blocks fails the test (TimeoutExpired) instead of hanging it."""
    script = tmp_path / "script.py"
    script.write_text(SCRIPT + textwrap.dedent(body))
    return subprocess.run([sys.executable, str(script), str(tmp_path / "run"), *args], capture_output=True, text=True,
                          cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, timeout=timeout)


def _log(tmp_path, name: str) -> str:
    return (tmp_path / "run" / "logs" / f"{name}.log").read_text(errors="replace")


MEGABYTES = r'''
    with router.capture(run_dir):
        with router.stage("sft") as path:
            line = "x" * 1023 + "\n"
            for _ in range(4096):  # 4 MiB to each of fd 1 and fd 2 from Python
                sys.stdout.write(line)
                sys.stderr.write(line)
            sys.stdout.flush()
            os.write(2, b"a C library's line\n" * 200_000)  # 4 MiB more, straight to the descriptor
            subprocess.run(["sh", "-c", "yes | head -c 4000000; yes | head -c 4000000 >&2"], check=True)
            say("sft: one of our lines")
        router.console.print(f"stage-ok {path}")
    print("run-ok")
'''


@pytest.mark.parametrize("disk", ["dev-full", "fills-up"])
def test_a_log_on_a_full_disk_warns_once_and_never_blocks_the_stage(tmp_path, disk):
    # dev-full: the stage's log is /dev/full from the start (ENOSPC at its first line). fills-up: the
    # log files may not grow past 16 KiB (RLIMIT_FSIZE, EFBIG), so sft.log fills in the middle of the
    # stage and its writes start failing while megabytes are still coming.
    setup = ('log_files_fail("full", "sft.log")\n' if disk == "dev-full" else
             "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
             "resource.setrlimit(resource.RLIMIT_FSIZE, (16384, 16384))\n")
    result = _script(tmp_path, setup + textwrap.dedent(MEGABYTES))
    assert result.returncode == 0, result.stderr[-3000:]
    console = (result.stdout + result.stderr).splitlines()
    assert "run-ok" in console and "sft: one of our lines" in "\n".join(console)
    assert any(line.startswith("stage-ok") for line in console)  # the block ended normally
    warnings = [line for line in console if "could not write" in line]
    assert len(warnings) == 1, console[-20:]
    assert "logs/sft.log" in warnings[0]
    assert ("No space left on device" if disk == "dev-full" else "File too large") in warnings[0]
    # The next log opened says what was lost.
    assert "library output since" in _log(tmp_path, "run") and "was dropped" in _log(tmp_path, "run")
    if disk == "fills-up":
        assert 0 < (tmp_path / "run" / "logs" / "sft.log").stat().st_size <= 16384


def test_a_log_that_cannot_be_opened_costs_the_stage_nothing(tmp_path):
    result = _script(tmp_path, r'''
        log_files_fail("read-only")
        with router.capture(run_dir):
            print("outside any stage")
            with router.stage("sft") as path:
                print("a library print")
                subprocess.run(["sh", "-c", "echo a child process line"], check=True)
                say("sft: one of our lines")
                (run_dir / "artifact").write_text("the stage's work")
            router.console.print(f"stage-ok {path}")
    ''')
    assert result.returncode == 0, result.stderr[-3000:]
    console = (result.stdout + result.stderr).splitlines()
    assert "stage-ok None" in console  # the block ran; it had no log to name
    assert (tmp_path / "run" / "artifact").read_text() == "the stage's work"
    assert "sft: one of our lines" in result.stdout
    warnings = [line for line in console if "could not write" in line]
    assert len(warnings) == 1 and "logs/run.log" in warnings[0] and "Read-only file system" in warnings[0], console


MALFORMED = [{"done": 1}, {"task": "sft", "done": "abc"}, {"task": "sft", "done": 1, "total": "12"},
             {"task": "sft", "by": None}, {"task": "sft", "done": float("inf"), "total": 4}, ["not", "a", "dict"],
             {"task": "sft", "done": 1, "total": 4, "note": {"a": [1]}, "unit": None}]


@pytest.mark.parametrize("live", [False, True])
def test_a_malformed_progress_event_never_kills_anything(tmp_path, live):
    result = _script(tmp_path, r'''
        bad = json.loads(sys.argv[2])
        with router.capture(run_dir):
            with router.stage("sft"):
                advance("sft", 0, 4, "step")
                for event in bad:  # from this process's own code
                    router.event(event)
                for event in bad:  # printed by a child process or a library of this one
                    print(MARK + json.dumps(event), flush=True)
                print(MARK + '{"task": "sft", "done": ', flush=True)  # cut short
                router._ray_batch({"pid": 7, "actor_name": "RayTrainWorker", "ip": "a", "localhost": "a",
                                   "lines": [MARK + json.dumps(event) for event in bad]})
                print("a line after the malformed ones", flush=True)
                print(MARK + json.dumps({"task": "sft", "done": 4, "total": 4}), flush=True)  # after those printed
            router.console.print("stage-ok")
    ''', json.dumps(MALFORMED), *(["live"] if live else []))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "stage-ok" in result.stdout and "4/4" in result.stdout
    log = _log(tmp_path, "sft")
    assert "a line after the malformed ones" in log
    assert log.count("dropped a malformed event") >= 2 * 6, log  # the driver's and the worker's, noted
    assert "Traceback" not in log + result.stderr


def test_a_malformed_progress_event_is_refused_before_it_reaches_a_bar():
    from pipeline.progress import progress_event

    for event in MALFORMED[:-1]:
        with pytest.raises(ValueError):
            progress_event(event)
    assert progress_event(MALFORMED[-1]) == {"task": "sft", "done": 1, "total": 4, "note": "{'a': [1]}",
                                             "unit": "step"}


def test_a_worker_progress_report_never_raises(capsys):
    from pipeline import events

    events.advance("sft", 1, 2, note=object())  # not JSON: sent as its text
    assert capsys.readouterr().out.startswith(MARK)


def test_a_child_that_crashes_leaves_its_output_in_the_log_and_the_console_names_the_log(tmp_path):
    result = _script(tmp_path, r'''
        crash = ("import faulthandler, sys; faulthandler.enable(); print('before-crash', flush=True); "
                 "import ctypes; ctypes.string_at(0)")
        with router.capture(run_dir):
            try:
                with router.stage("sft"):
                    subprocess.run([sys.executable, "-c", crash], check=True)
            except subprocess.CalledProcessError:
                router.console.print("stage-failed")
    ''')
    assert result.returncode == 0, result.stderr[-3000:]
    log = _log(tmp_path, "sft")
    # What the child printed, then its fatal error, then the stage's traceback after all of it.
    assert 0 <= log.find("before-crash") < log.find("Fatal Python error: Segmentation fault") < log.find(
        "CalledProcessError"), log
    failed = [line for line in result.stdout.splitlines() if "sft failed" in line]
    assert len(failed) == 1 and "its log: " in failed[0] and "logs/sft.log" in failed[0], result.stdout


def test_a_command_log_keeps_the_console_to_our_lines_one_notice_per_traceback_and_names_the_log(tmp_path):
    """A routed command (`serve`, `batch-infer`, `compare`) as `run` is: library output in its own log
    (`serve` in serve-command.log, the serve stage's serve.log untouched), a traceback logged by vLLM a
    line at a time one notice, the engine's teardown traceback none, and the failure's line naming the log."""
    result = _script(tmp_path, r'''
        from pipeline import console

        vllm = "(MainProcess pid=7) ERROR 12-01 19:11:55 "
        dead = [vllm + "[core.py:12] EngineCore failed.", vllm + "[core.py:12] Traceback (most recent call last):",
                vllm + '[core.py:12]   File "core.py", line 1', vllm + "[core.py:12] RuntimeError: boom"]
        teardown = [vllm + "[async_llm.py:906] AsyncLLM output_handler failed.",
                    vllm + "[async_llm.py:906] vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered"]
        try:
            with console.command_log(run_dir, "serve", "serve-command") as log:
                say(f"serve: library output in {log}")
                print("INFO a library line")
                for lines in (dead, teardown):
                    router._ray_batch({"pid": 7, "actor_name": "MapWorker", "ip": "a", "localhost": "a",
                                       "lines": lines})
                raise RuntimeError("the command failed")
        except RuntimeError:
            router.console.print("command-failed")
    ''')
    assert result.returncode == 0, result.stderr[-3000:]
    console, log = (result.stdout + result.stderr).splitlines(), _log(tmp_path, "serve-command")
    path = tmp_path / "run" / "logs" / "serve-command.log"
    assert console[0].endswith(f"serve: library output in {path}"), console
    assert console[1] == f"  ! serve: (MapWorker pid=7) (MainProcess pid=7) ERROR 12-01 19:11:55 [core.py:12] " \
                         f"EngineCore failed. (see {path})", console
    assert console[2:] == [f"  serve failed; its log: {path}", "command-failed"], console  # nothing else
    for line in ("INFO a library line", "RuntimeError: boom", "AsyncLLM output_handler failed",
                 "RuntimeError: the command failed"):
        assert line in log, line
    assert not (tmp_path / "run" / "logs" / "serve.log").exists()


def test_a_fatal_signal_in_the_driver_dumps_its_stacks_into_the_stage_log(tmp_path):
    # The pump thread dies with the process, so the dump cannot go through the pipe.
    result = _script(tmp_path, r'''
        with router.capture(run_dir):
            with router.stage("sft"):
                import ctypes
                ctypes.string_at(0)
    ''')
    assert result.returncode == -signal.SIGSEGV
    log = _log(tmp_path, "sft")
    assert "Fatal Python error: Segmentation fault" in log and "script.py" in log, log


def test_a_console_that_went_away_does_not_stop_the_run(tmp_path):
    result = _script(tmp_path, r'''
        with router.capture(run_dir):
            with router.stage("sft"):
                print("a library print")
                say("sft: one of our lines")
                for step in range(3):
                    advance("sft", step, 2)
                logging.getLogger("vllm").error("EngineDeadError: the engine died")
            router.console.print("summary")
        (run_dir / "finished").write_text("yes")
    ''', "console-gone")
    assert result.returncode == 0
    assert (tmp_path / "run" / "finished").exists()
    assert "a library print" in _log(tmp_path, "sft")
