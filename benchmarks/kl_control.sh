#!/usr/bin/env bash
# KL-control proof (benchmarks/learning.md): the arithmetic recipe with kl.coef=0.05 under a fixed
# coefficient, then each controller with target_kl set to half the KL the fixed run reached over its
# last 5 steps (so every controller has to act). 4 prompts x 4 samples per step (half the recipe's
# batch, for time), STEPS=10 by default; writes runs/kl-proof/<type>/.
# Table: python benchmarks/proof_table.py kl runs/kl-proof
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${STEPS:-10}
OUT=${OUT:-runs/kl-proof}
PY=${PY:-.venv/bin/python}
run() {  # name, overrides...
  local name=$1; shift
  OMP_NUM_THREADS=1 $PY -m torch.distributed.run --standalone --nproc_per_node=2 trainers/ppo.py config=arithmetic \
    kl.coef=0.05 rollout.prompts_per_rollout=4 trainer.total_steps="$STEPS" trainer.eval_at_start=false \
    trainer.eval_n=50 trainer.progress=false \
    trainer.output_dir="$OUT/$name" "$@" > "$OUT/$name.log" 2>&1
  rm -rf "$OUT/$name"/checkpoint-*  # 2 GB each; the proof needs only metrics.jsonl
}
mkdir -p "$OUT"
run fixed
TARGET=$($PY - "$OUT/fixed/metrics.jsonl" <<'PYEOF'
import json, sys
kl = [r["actor/kl"] for r in map(json.loads, open(sys.argv[1])) if "actor/kl" in r]
print(f"{0.5 * sum(kl[-5:]) / len(kl[-5:]):.3g}")
PYEOF
)
echo "target_kl=$TARGET" | tee "$OUT/target.txt"
A="kl.adaptive.target_kl=$TARGET"
run proportional kl.adaptive.type=proportional "$A" kl.adaptive.horizon=16
run exponential kl.adaptive.type=exponential "$A" kl.adaptive.exp_factor=1.5 kl.adaptive.exp_decay=0.8
run linear kl.adaptive.type=linear "$A" kl.adaptive.linear_factor=0.5
run pid kl.adaptive.type=pid "$A" kl.adaptive.kp=1.0 kl.adaptive.ki=0.3 kl.adaptive.kd=0.1
run schedule kl.adaptive.type=schedule "$A" kl.adaptive.schedule_type=linear kl.adaptive.final_coef=0.5 \
  kl.adaptive.schedule_steps="$STEPS"
echo done
