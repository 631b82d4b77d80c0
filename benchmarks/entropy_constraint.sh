#!/usr/bin/env bash
# Entropy-constraint proof (benchmarks/learning.md): the arithmetic recipe at a raised learning rate
# (4e-5, so the entropy collapse of the 110-step run shows within STEPS=15 steps), 4 prompts x 4
# samples per step, without and with constraints.entropy.bound (same seed).
# Writes runs/entropy-proof/{unconstrained,constrained}/. Table: python benchmarks/proof_table.py entropy runs/entropy-proof
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${STEPS:-15}
BOUND=${BOUND:-0.6}
LAGRANGIAN_LR=${LAGRANGIAN_LR:-1.0}
OUT=${OUT:-runs/entropy-proof}
PY=${PY:-.venv/bin/python}
run() {  # name, overrides...
  local name=$1; shift
  OMP_NUM_THREADS=1 $PY -m torch.distributed.run --standalone --nproc_per_node=2 trainers/ppo.py config=arithmetic \
    actor.lr=4e-5 rollout.prompts_per_rollout=4 trainer.total_steps="$STEPS" trainer.eval_at_start=false \
    trainer.eval_n=50 trainer.progress=false trainer.output_dir="$OUT/$name" "$@" > "$OUT/$name.log" 2>&1
  rm -rf "$OUT/$name"/checkpoint-*  # 2 GB each; the proof needs only metrics.jsonl
}
mkdir -p "$OUT"
[ -f "$OUT/unconstrained/metrics.jsonl" ] || run unconstrained  # the baseline does not depend on the bound
run constrained constraints.entropy.bound="$BOUND" constraints.lagrangian_lr="$LAGRANGIAN_LR"
echo done
