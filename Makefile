# Optima: the two commands of the README, and their parts.
#   make demo   set up (if needed) and run the 2-iteration iSFT demo on SmolLM2-135M (CPU: about 13 min after set-up, the held-out table included),
#               then print its time per iteration and its report (python -m dev.demo)
#   make demo-hotpot   the same on HotpotQA (information exchange; CPU: about 15 min after set-up)
#   make test   set up (if needed) and run the default test suite (about 10 min on a quiet 2-core box)
#   (set-up: about 2 min with the wheels on local disk, about 6 min downloading them; 4.8 GB of disk)
#   make gpu-check  on one NVIDIA GPU: set up, iSFT + iDPO (bf16, ZeRO-3), wake with new weights, loss server beside
#                   the policy, 2-rank ZeRO-3 save; each stage PASS/FAIL/SKIP (python3 -m dev.gpu_check)
#   make bench  the benchmarks of bench/ (python -m bench.run_all), written to bench/RESULTS.md
PYTHON ?= python3
TRAIN_PY := .venvs/train/bin/python
# Data: the demos, tests and benchmarks read the samples in data/ (data/README.md); OPTIMA_DATA_DIR=<folder> in
# the environment points the tests and benchmarks at another copy.

.PHONY: setup test test-slow lint demo demo-hotpot bench gpu-check

setup:
	$(PYTHON) -m optima setup

lint: setup
	$(TRAIN_PY) -m ruff check .
	$(TRAIN_PY) -m ruff format --check .

test: setup lint
	$(TRAIN_PY) -m pytest

test-slow: setup
	$(TRAIN_PY) -m pytest -m slow

demo: setup
	$(TRAIN_PY) -m dev.demo

demo-hotpot: setup
	$(TRAIN_PY) -m dev.demo --recipe train/sft_recipes/demo_hotpot_qa.yaml

bench: setup
	$(TRAIN_PY) -m bench.run_all

gpu-check:
	$(PYTHON) -m dev.gpu_check
