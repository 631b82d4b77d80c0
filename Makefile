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

# The main job, short: 3 PPO steps (Dr. GRPO) of SmolLM2-135M-Instruct on reasoning-gym
# arithmetic with 2 ranks (FSDP2 over gloo); prints the reward table and where the plot and
# the checkpoint are. Drop the trainer.* overrides for the full proof-of-learning recipe.
run: setup
	OMP_NUM_THREADS=1 $(BIN)/python -m torch.distributed.run --standalone --nproc_per_node=2 trainers/ppo.py \
		config=arithmetic trainer.total_steps=3 trainer.eval_n=64 trainer.output_dir=runs/quickstart trainer.progress=false

test: setup
	$(BIN)/python -m pytest -q

test-fast: setup
	$(BIN)/python -m pytest -q -m "not slow"

bench: setup
	$(BIN)/python benchmarks/env_throughput.py
	$(BIN)/python benchmarks/retrieval.py
	$(BIN)/python benchmarks/rollout.py
	$(BIN)/python benchmarks/trainer.py

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
