"""What the `code_tests` reward costs per scored response: median and p95 wall time of one `code_tests` call, on
MBPP-style rows (top-level asserts) and HumanEval-style rows (`def check(candidate)`), for honest answers and
honest wrong ones (tests/code_corpus.py: MBPP, HUMANEVAL), each in the sandbox tier this machine gives;
and which attacks of the corpus (ATTACKS) each checkout scores 1.0.

With `--against DIR` (another checkout, e.g. `git worktree add /tmp/before <commit>`) it scores the same corpus
with that checkout's `code_tests` too, the two alternating in rounds (A B A B ...) in one invocation, so the ratio
holds while the machine's speed drifts; a row that checkout refuses (a ValueError: the pre-issue-67 harness could
not judge HumanEval's `check(candidate)`) is counted as refused, not timed. The machine's calibration is printed
first (bench/machine.py).

    .venv/bin/python bench/code_tests.py                                  # this checkout alone
    .venv/bin/python bench/code_tests.py --against /tmp/before --rounds 5 --json bench/code_tests.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

# Scores every (kind, answer) of the corpus once in a fresh process of the checkout given: one JSON line of
# {category: {row index: seconds}}, the scores alike, and {category: rows refused}. The corpus is read from this
# checkout (plain data).
WORKER = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
sys.path.insert(0, sys.argv[2])
import code_corpus as corpus
from stages.ppo.sandbox import code_tests

def row_of(tests):
    return tests if isinstance(tests, dict) else {"tests": tests, "test_setup_code": "K = 2"}

code_tests("", "def f():\n    return 1", {"test": "assert f() == 1"})  # the tier's one-off probe, not timed
times, refused, scores = {}, {}, {}
for kind, rows in (("mbpp", corpus.MBPP), ("humaneval", corpus.HUMANEVAL)):
    for i, (tests, right, wrong) in enumerate(rows):
        for answer, code in (("honest", right), ("wrong", wrong)):
            key = kind + " " + answer
            t0 = time.perf_counter()
            try:
                score = code_tests("", code, row_of(tests))
            except ValueError:
                refused[key] = refused.get(key, 0) + 1
                continue
            times.setdefault(key, {})[i] = time.perf_counter() - t0
            scores.setdefault(key, {})[i] = score
passing = []  # the attack corpus, untimed: which attacks this checkout scores 1.0
for name, (code, row) in corpus.ATTACKS.items():
    try:
        if code_tests("", code, row) == 1.0:
            passing.append(name)
    except ValueError:
        pass
print(json.dumps({"times": times, "refused": refused, "scores": scores, "attacks_passing": passing}))
"""

CATEGORIES = ("mbpp honest", "mbpp wrong", "humaneval honest", "humaneval wrong")


def one_pass(checkout: Path) -> dict:
    out = subprocess.run([sys.executable, "-c", WORKER, str(checkout), str(ROOT / "tests")],
                         capture_output=True, text=True, timeout=1800, cwd=checkout)
    if out.returncode != 0:
        raise SystemExit(f"scoring with {checkout} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def commit(checkout: Path) -> str:
    out = subprocess.run(["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(checkout), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    return out.stdout.strip() + (" + uncommitted changes" if dirty else "")


def corpus_attacks() -> dict:
    sys.path.insert(0, str(ROOT / "tests"))
    import code_corpus

    return code_corpus.ATTACKS


def p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]


def summary(passes: list[dict], rows: dict[str, set] | None = None) -> dict:
    """Per category: the calls timed, median and p95 ms, the rows refused per pass, and the mean score; with
    `rows`, only those rows (the ones both checkouts judged)."""
    out = {}
    for cat in CATEGORIES:
        keep = (lambda i: i in rows[cat]) if rows is not None else (lambda i: True)
        times = [t for p in passes for i, t in p["times"].get(cat, {}).items() if keep(i)]
        scores = [s for p in passes for i, s in p["scores"].get(cat, {}).items() if keep(i)]
        out[cat] = {"calls": len(times), "median_ms": round(1000 * statistics.median(times), 1) if times else None,
                    "p95_ms": round(1000 * p95(times), 1) if times else None,
                    "refused_per_pass": passes[0]["refused"].get(cat, 0),
                    "mean_score": round(statistics.mean(scores), 3) if scores else None}
    return out


def print_table(title: str, checkouts: dict, results: dict, ratio: bool) -> None:
    print(f"\n{title}\n{'category':<18}" + "".join(f"{n + ' median / p95 ms':>32}" for n in checkouts) +
          ("   median ratio" if ratio else ""))
    for cat in CATEGORIES:
        cells = []
        for name in checkouts:
            s = results[name][cat]
            cells.append(f"refused ({s['refused_per_pass']} rows)" if s["median_ms"] is None else
                         f"{s['median_ms']:.1f} / {s['p95_ms']:.1f} (n={s['calls']})")
        note = ""
        if ratio and results["this"][cat]["median_ms"] and results["against"][cat]["median_ms"]:
            note = f"   {results['this'][cat]['median_ms'] / results['against'][cat]['median_ms']:.2f}x"
        print(f"{cat:<18}" + "".join(f"{c:>32}" for c in cells) + note)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--against", type=Path, help="another checkout to score the same corpus with (the before)")
    parser.add_argument("--rounds", type=int, default=3, help="passes over the corpus per checkout (default 3)")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()

    from machine import announce
    from stages.ppo import sandbox

    calibration = announce()
    print(f"sandbox tier: {sandbox.isolation()} ({sandbox.interpreter()})")
    checkouts = {"this": ROOT} | ({"against": args.against.resolve()} if args.against else {})
    passes: dict[str, list[dict]] = {name: [] for name in checkouts}
    t0 = time.time()
    for r in range(args.rounds):
        for name, path in (checkouts.items() if r % 2 == 0 else reversed(checkouts.items())):
            passes[name].append(one_pass(path))
            print(f"round {r + 1}/{args.rounds}: {name} done ({time.time() - t0:.0f} s)", flush=True)
    results = {name: summary(p) for name, p in passes.items()}
    print_table("every row each checkout judged", checkouts, results, bool(args.against))
    if args.against:  # like for like: the rows both judged
        both = {cat: set.intersection(*[set(p[0]["times"].get(cat, {})) for p in passes.values()])
                for cat in CATEGORIES}
        results["common"] = {name: summary(p, both) for name, p in passes.items()}
        print_table("the rows both checkouts judged", checkouts, results["common"], True)
    print(f"\nattacks scoring 1.0 (tests/code_corpus.py, {len(corpus_attacks())} attacks):")
    for name, p in passes.items():
        results[name]["attacks_passing"] = p[0]["attacks_passing"]
        print(f"  {name}: {len(p[0]['attacks_passing'])}" + "".join(f"\n    {a}" for a in p[0]["attacks_passing"]))
    if args.json:
        args.json.write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(t0)),
                                         "command": " ".join(["bench/code_tests.py"] + sys.argv[1:]),
                                         "calibration": {"speed": round(calibration.speed, 3),
                                                         "line": calibration.line()}, "tier": sandbox.isolation(),
                                         "checkouts": {k: f"{v} at {commit(v)}" for k, v in checkouts.items()},
                                         "results": results}, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
