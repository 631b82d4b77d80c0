# rl2gem: set-up, main job, tests.  `make run` and `make test` work on a fresh machine.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.rl2gem-installed
TORCH_VERSION := 2.13.0
# Every other package `make setup` installs, pinned with hashes (`make lock` regenerates it).
LOCK   := requirements.lock

.PHONY: setup run test test-slow test-all test-soak test-latest lint lock bench sft-searchqa preference-arithmetic clean

setup: $(STAMP)

# torch goes in first, pinned and on its own (--no-deps: its dependencies are in the lock): it is
# the CPU build from the wheel source pip is configured with, which is not on PyPI, so it cannot be
# hash-pinned in the lock; a looser install would fetch a CUDA build of several GB. Then the lock,
# hash-checked and with --no-deps (it is complete), then rl2gem itself, editable, with no
# dependencies of its own to resolve. `pip check` fails the set-up if the set is inconsistent.
# Every module is byte-compiled here, once: the 2-core machine sets PYTHONDONTWRITEBYTECODE=1, so
# nothing compiled later is kept and every process would compile torch and transformers again (a CI
# run took 2280 s that way), and rl2gem's own 108 files (0.4 s per process that imports them all).
# pip installs without compiling and compileall then compiles on every core: torch and the lock in
# 105 s instead of pip's one-core 132 s. Like pip, it skips files that are not Python 3.11 (torch's
# py312_intrinsics.py); rl2gem's own must compile.
$(STAMP): pyproject.toml $(LOCK)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip "setuptools>=77"
	$(BIN)/python -m pip install -q --no-compile --no-deps torch==$(TORCH_VERSION)
	$(BIN)/python -m pip install -q --no-compile --no-deps --require-hashes -r $(LOCK)
	$(BIN)/python -m pip install -q --no-deps -e .
	$(BIN)/python -c "import compileall; compileall.compile_dir('$(VENV)/lib', quiet=2, workers=0)"
	$(BIN)/python -m compileall -q -j 0 rl2gem envs trainers
	$(BIN)/python -m pip check
	touch $@

# The main job, short: 3 PPO steps (Dr. GRPO) of SmolLM2-135M-Instruct on reasoning-gym
# arithmetic with 2 ranks (FSDP2 over gloo); prints the reward table and where the plot and
# the checkpoint are. Drop the trainer.* overrides for the full proof-of-learning recipe.
run: setup
	rm -rf runs/quickstart  # a new run each time (trainers refuse a folder that holds a run without trainer.resume=true)
	OMP_NUM_THREADS=1 $(BIN)/python -m torch.distributed.run --standalone --nproc_per_node=2 trainers/ppo.py \
		config=arithmetic trainer.total_steps=3 trainer.eval_n=64 trainer.output_dir=runs/quickstart trainer.progress=false

# SFT proof on real input (about 35 min on 2 cores; README, benchmarks/learning.md): oracle
# episodes of rl2/SearchQA-v0's train split -> SFT of SmolLM2-135M-Instruct -> greedy EM, F1 and
# searches per episode on the first 200 test questions, before and after.
sft-searchqa: setup
	rm -rf runs/searchqa-sft
	$(BIN)/python -m rl2gem.collect env=rl2/SearchQA-v0 policy=solver split=train n=5000 env_kwargs.topk=1 \
		output=runs/searchqa/oracle-top1.jsonl progress=false
	OMP_NUM_THREADS=1 $(BIN)/python -m torch.distributed.run --standalone --nproc_per_node=2 trainers/sft.py \
		config=searchqa_sft trainer.progress=false

# Preference proof on real input (README, benchmarks/learning.md): SmolLM2-135M-Instruct's own
# samples on the arithmetic recipe's task -> preference pairs (train items; held-out pairs from
# test items) -> DPO, and a reward model that is then PPO's only reward.
ARITHMETIC := 'env_kwargs={task: basic_arithmetic, min_terms: 2, max_terms: 2, min_digits: 1, max_digits: 2, operators: ["+", "-"], allow_negation: false, allow_parentheses: false, answer: last_number}'
PAIRS := $(BIN)/python -m rl2gem.collect env=rl2/ReasoningGym-v0 $(ARITHMETIC) model=smollm2-135m-instruct pairs=true \
	responses_per_prompt=8 max_new_tokens=32 batch_size=64 progress=false
TORCHRUN := OMP_NUM_THREADS=1 $(BIN)/python -m torch.distributed.run --standalone --nproc_per_node=2
preference-arithmetic: setup
	rm -rf runs/arithmetic-dpo runs/arithmetic-rm runs/arithmetic-ppo-rm
	$(PAIRS) split=train n=640 output=runs/arithmetic-pairs/train.jsonl
	$(PAIRS) split=test n=200 output=runs/arithmetic-pairs/test.jsonl
	$(TORCHRUN) trainers/dpo.py config=arithmetic_dpo trainer.progress=false
	$(TORCHRUN) trainers/rm.py config=arithmetic_rm trainer.progress=false
	$(TORCHRUN) trainers/ppo.py config=arithmetic reward.model=runs/arithmetic-rm reward.mode=replace \
		trainer.total_steps=20 trainer.output_dir=runs/arithmetic-ppo-rm trainer.progress=false

# The default suite (CI): everything but the tests marked slow (long real-model runs another test
# covers at smoke size, e.g. the README's commands as written) and soak. TEST_WORKERS pytest
# workers (pytest-xdist; each with one OpenMP thread, tests/conftest.py) share the tests out, an
# idle one taking tests from a busy one: a serial run leaves a core idle while a test waits on a
# subprocess's start. TEST_WORKERS=0 runs them in this process, one after another.
TEST_WORKERS ?= 2
PYTEST := $(BIN)/python -m pytest -q --durations=25 -n $(TEST_WORKERS) --dist worksteal
test: setup
	$(PYTEST) -m "not slow and not soak"

# The long real-model runs (also run by make bench), and everything at once.
test-slow: setup
	$(PYTEST) -m "slow and not soak"

test-all: setup
	$(PYTEST) -m "not soak"

# Endurance runs (a minute or more each, e.g. the sandbox's fork server over 10,000 executions).
test-soak: setup
	$(BIN)/python -m pytest -q -m soak

# ruff, pinned in the dev extra (also the pre-commit hook): lint rules and formatting, checked, not fixed.
lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# Drift on purpose: a fresh .venv-latest with the newest versions pyproject.toml allows (torch
# still $(TORCH_VERSION), installed first), then the fast tests. A failure here is the next lock's
# problem found before users find it; see README, "Dependencies".
LATEST := .venv-latest
test-latest:
	rm -rf $(LATEST)
	$(PYTHON) -m venv $(LATEST)
	$(LATEST)/bin/python -m pip install -q --upgrade pip "setuptools>=77"
	$(LATEST)/bin/python -m pip install -q torch==$(TORCH_VERSION)
	$(LATEST)/bin/python -m pip install -q -e ".[dev,bench]"
	$(LATEST)/bin/python -m pip list --format=freeze | grep -iE '^(torch|transformers|datasets|trl|numpy|gymnasium)=='
	$(LATEST)/bin/python -m pytest -q -n $(TEST_WORKERS) --dist worksteal -m "not slow and not soak"

# Regenerates $(LOCK) from pyproject.toml's ranges for Python 3.11 on Linux x86-64 with uv (in
# .venv-uv). Versions already in the lock are kept where still allowed; LOCK_FLAGS=--upgrade moves
# everything to the newest allowed, LOCK_FLAGS="--upgrade-package transformers" one package.
# torch is resolved as the CPU build ($(TORCH_WHEELS): pip's find-links here, else PyTorch's CPU
# wheel page) so that no CUDA package enters the lock, and is left out of it.
UV_VERSION   := 0.13.9
TORCH_WHEELS ?= $(or $(PIP_FIND_LINKS),https://download.pytorch.org/whl/cpu/torch/)
LOCK_FLAGS   ?=
define LOCK_NOTE
# rl2gem's dependency lock: what `make setup` installs (pip install --no-deps --require-hashes -r requirements.lock),
# for Python 3.11 on Linux x86-64. Refresh with `make lock` (README, "Dependencies"); do not edit by hand.
# torch is not in it: make setup installs torch==$(TORCH_VERSION) (CPU build, torch-$(TORCH_VERSION)+cpu) first, from
# the wheel source pip is configured with; that build is not on PyPI, so it has no hash here. The lock was
# resolved against that build's dependencies, so it holds torch's own (CPU) dependencies and no CUDA packages.
endef
export LOCK_NOTE

lock: .venv-uv/bin/uv
	printf 'torch==$(TORCH_VERSION)+cpu\n' | .venv-uv/bin/uv pip compile pyproject.toml - --extra dev --extra bench \
		--python-version 3.11 --python-platform x86_64-manylinux_2_28 --generate-hashes \
		--no-emit-package torch --find-links $(TORCH_WHEELS) --custom-compile-command "make lock" \
		$(LOCK_FLAGS) -o $(LOCK)
	! grep -qiE '^(nvidia-|triton|cuda-)' $(LOCK) || { echo "lock: CUDA packages in $(LOCK): torch was not the CPU build" >&2; exit 1; }
	{ echo "$$LOCK_NOTE"; cat $(LOCK); } > $(LOCK).tmp && mv $(LOCK).tmp $(LOCK)

.venv-uv/bin/uv:
	$(PYTHON) -m venv .venv-uv
	.venv-uv/bin/python -m pip install -q uv==$(UV_VERSION)

bench: setup
	$(BIN)/python benchmarks/env_throughput.py
	$(BIN)/python benchmarks/env_server.py
	$(BIN)/python benchmarks/retrieval.py
	$(BIN)/python benchmarks/rollout.py
	$(BIN)/python benchmarks/trainer.py --lora 16
	$(BIN)/python benchmarks/tree_packing.py
	$(BIN)/python benchmarks/parallel.py
	$(BIN)/python benchmarks/fsdp_one_rank.py
	$(BIN)/python benchmarks/sandbox.py
	$(BIN)/python benchmarks/logprob_mismatch.py
	$(BIN)/python benchmarks/detokenize.py
	$(BIN)/python benchmarks/engine_host.py
	$(MAKE) test-slow
	$(MAKE) test-soak

clean:
	rm -rf $(VENV) $(LATEST) .venv-uv *.egg-info .pytest_cache
