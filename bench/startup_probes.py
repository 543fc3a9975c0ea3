"""Two probes behind docs/startup.md: what a worker's imports cost, and what Ray Train's own start costs.

    .venv/bin/python bench/startup_probes.py imports --repeats 2   # a worker's imports, lean and not
    .venv/bin/python bench/startup_probes.py train --repeats 3     # a TorchTrainer whose loop does nothing

`imports`: a fresh interpreter per run (alternating lean / full) imports DeepSpeed (DS_ACCELERATOR=cpu) and
transformers' `LlamaForCausalLM` + `transformers.generation`, as a Train rank or PPO rank does before its
first step; lean is `stages.common.startup` (`lean_imports()`, `import_deepspeed()`). Prints the seconds
of each run, and whether scikit-learn and MLflow were imported.

`train`: starts a local Ray (6 logical CPUs, as the default's runs), then per repeat a 2-worker
`TorchTrainer` (gloo) whose loop only records when it began; prints the seconds from `fit()` to the
loop's start and to `fit()`'s return, and the processes Ray started meanwhile with their creation time
after `fit()` (read from rank 0). `--env K=V` sets Ray Train variables for the driver (e.g.
RAY_TRAIN_HEALTH_CHECK_INTERVAL_S=0.25). Ray is shut down at the end, also on failure.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

IMPORTS = """
import os, sys, time
os.environ["DS_ACCELERATOR"] = "cpu"
t0 = time.time()
if {lean}:
    from stages.common.startup import import_deepspeed, lean_imports
    lean_imports()
    import_deepspeed()
else:
    from pipeline.upstream.torch_extensions import isolate_jit_builds
    isolate_jit_builds()
    import deepspeed
from transformers import LlamaForCausalLM
import transformers.generation
print(time.time() - t0, "sklearn" in sys.modules, "mlflow" in sys.modules)
"""


def imports(repeats: int) -> None:
    for _ in range(repeats):
        for lean in (False, True):
            out = subprocess.run([sys.executable, "-c", IMPORTS.format(lean=lean)], cwd=ROOT, capture_output=True,
                                 text=True, check=True)
            seconds, sklearn, mlflow = out.stdout.split()[-3:]
            print(f"{'lean' if lean else 'full'}: {float(seconds):.2f} s (scikit-learn imported: {sklearn}, "
                  f"MLflow imported: {mlflow})", flush=True)


def _loop(c: dict) -> None:
    """Rank 0 writes when the loop began and the Ray processes alive then (creation times after fit())."""
    began = time.time()
    import psutil
    import ray.train

    if ray.train.get_context().get_world_rank() == 0:
        procs = []
        for p in psutil.process_iter():
            try:
                cmd, created = " ".join(p.cmdline()), p.create_time()
            except psutil.Error:
                continue
            if created >= c["fit"] - 1 and ("ray::" in cmd or "default_worker" in cmd):
                procs.append((round(created - c["fit"], 1), cmd.split()[0][:40]))
        Path(c["out"]).write_text(json.dumps({"began": began, "procs": sorted(procs)}))


def train(repeats: int) -> None:
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    ray.init(num_cpus=6, include_dashboard=False, log_to_driver=False)
    try:
        with tempfile.TemporaryDirectory() as d:
            for i in range(repeats):
                out = Path(d) / f"loop{i}.json"
                fit = time.time()
                TorchTrainer(_loop, train_loop_config={"fit": fit, "out": str(out)},
                             torch_config=TorchConfig(backend="gloo"), scaling_config=ScalingConfig(num_workers=2),
                             run_config=RunConfig(name=f"probe{i}", storage_path=d)).fit()
                done = time.time()
                seen = json.loads(out.read_text())
                print(f"run {i}: loop began {seen['began'] - fit:.1f} s after fit(), fit() returned after "
                      f"{done - fit:.1f} s; processes started (s after fit()): {seen['procs']}", flush=True)
    finally:
        ray.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("probe", choices=("imports", "train"))
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--env", nargs="*", default=[], help="K=V set in this process first (Ray Train variables)")
    args = ap.parse_args()
    os.environ.update(dict(kv.split("=", 1) for kv in args.env))
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: {' '.join(sys.argv)}", flush=True)
    imports(args.repeats) if args.probe == "imports" else train(args.repeats)


if __name__ == "__main__":
    import machine  # bench/machine.py: the machine's speed, printed before any figure

    machine.announce()
    main()
