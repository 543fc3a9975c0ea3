# The two set-up commands of the README:
#   make run    install everything, then run the embedded default pipeline (configs/full.yaml)
#   make test   install everything, then run the test suite
PY := .venv/bin/python
EXTRA ?= cpu

.PHONY: setup run test test-all test-fast bench bench-learning image-check

setup:
	EXTRA=$(EXTRA) bash scripts/setup.sh

run: setup
	$(PY) -m pipeline run configs/full.yaml

# Every run prints the machine's calibration, its wall time raw and normalised against the budget, the time
# per module, each module's starts and the 15 slowest tests (docs/development.md: budgets, tiers, the rule a
# feature's tests follow).
# `make test` (CI): the base tier, and each tiered scenario whose covered code changed since the recorded full
# pass (tests/full_pass.json); the ones left out are listed with the reason.
test: setup
	$(PY) -m pytest --tiers=changed --durations=15

# Every test; on a clean checkout that passes, records the commit in tests/full_pass.json (commit that file).
test-all: setup
	$(PY) -m pytest --tiers=all --record-full-pass --durations=15

test-fast: setup
	$(PY) -m pytest -m "not slow" --durations=15

# Build the container image with podman (no registry needed) and run the smoke pipeline in it: about 25 minutes
# as root, not part of `make test` (scripts/image_check.sh, docs/install.md). EXTRA=gpu builds the GPU image and
# checks what a machine without a GPU can (the CUDA builds installed), saying what it could not.
image-check:
	EXTRA=$(EXTRA) bash scripts/image_check.sh

bench: setup
	$(PY) bench/data_bench.py
	$(PY) bench/train_bench.py
	$(PY) bench/rollout_bench.py

# Does RL on the verifier make the embedded model better? Seeds 0-2, PPO and GRPO: about an hour on 2 cores.
# Does the default's RLHF raise the gold preference and keep correctness? Seeds 0-2, PPO: about 30 minutes.
bench-learning: setup
	$(PY) bench/learning.py --seeds 0 1 2 --algorithms ppo grpo --fresh --json bench/learning.json
	$(PY) bench/rlhf.py --config configs/full.yaml --seeds 0 1 2 --algorithms ppo --json bench/rlhf_mix.json
