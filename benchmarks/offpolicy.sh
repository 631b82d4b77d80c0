#!/usr/bin/env bash
# Off-policy correction proof (benchmarks/learning.md): the arithmetic recipe with a critic and partial
# rollouts (rollout.partial_rollout=true, partial_oversample=1.0, max_staleness=2: later steps train on
# tokens older weights sampled), GAE with truncated importance sampling against V-trace, same seed,
# 4 prompts x 4 samples, STEPS=10. Writes runs/offpolicy-proof/{gae_tis,vtrace}/.
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${STEPS:-10}
OUT=${OUT:-runs/offpolicy-proof}
PY=${PY:-.venv/bin/python}
run() {  # name, overrides...
  local name=$1; shift
  OMP_NUM_THREADS=1 $PY -m torch.distributed.run --standalone --nproc_per_node=2 trainers/ppo.py config=arithmetic \
    rollout.prompts_per_rollout=4 rollout.partial_rollout=true rollout.partial_oversample=1.0 rollout.max_staleness=2 \
    trainer.total_steps="$STEPS" trainer.eval_at_start=false trainer.eval_n=50 trainer.progress=false \
    trainer.output_dir="$OUT/$name" "$@" > "$OUT/$name.log" 2>&1
  rm -rf "$OUT/$name"/checkpoint-*  # 2 GB each; the proof needs only metrics.jsonl
}
mkdir -p "$OUT"
run gae_tis adv.estimator=gae rollout.is_mode=truncated
run vtrace adv.estimator=vtrace adv.vtrace.rho_bar=1.0 adv.vtrace.c_bar=1.0
echo done
