#!/usr/bin/env bash
# The enhanced-RL2 proof runs of benchmarks/learning.md on the arithmetic recipe (config=arithmetic),
# 4 prompts x 4 samples per step (half the recipe's batch, for time), 2 ranks, checkpoints deleted
# after each run (2 GB each; the proofs read only metrics.jsonl). Tables and plots:
# python benchmarks/proof_table.py <kind> runs/<kind>-proof
#
#   bash benchmarks/proofs.sh kl         # kl.coef=0.05 fixed, then each controller with target_kl set to half
#                                        # the KL the fixed run reached over its last 5 steps (STEPS=10)
#   bash benchmarks/proofs.sh entropy    # lr 4e-5 without and with constraints.entropy.bound=BOUND (STEPS=15)
#   bash benchmarks/proofs.sh offpolicy  # a critic and partial rollouts (max_staleness 2): GAE with truncated
#                                        # IS against V-trace (STEPS=10)
set -euo pipefail
cd "$(dirname "$0")/.."
KIND=${1:?usage: bash benchmarks/proofs.sh kl|entropy|offpolicy}
OUT=${OUT:-runs/$KIND-proof}
PY=${PY:-.venv/bin/python}
run() {  # name, overrides...
  local name=$1; shift
  rm -rf "${OUT:?}/$name"  # a new run (a folder that holds one is refused without trainer.resume=true)
  OMP_NUM_THREADS=1 $PY -m torch.distributed.run --standalone --nproc_per_node=2 trainers/ppo.py config=arithmetic \
    rollout.prompts_per_rollout=4 trainer.eval_at_start=false trainer.eval_n=50 trainer.progress=false \
    trainer.output_dir="$OUT/$name" "$@" > "$OUT/$name.log" 2>&1
  rm -rf "$OUT/$name"/checkpoint-* "$OUT/$name/latest"
}
mkdir -p "$OUT"
case "$KIND" in
  kl)
    S="trainer.total_steps=${STEPS:-10}"
    run fixed kl.coef=0.05 "$S"
    TARGET=$($PY - "$OUT/fixed/metrics.jsonl" <<'PYEOF'
import json, sys
kl = [r["actor/kl"] for r in map(json.loads, open(sys.argv[1])) if "actor/kl" in r]
print(f"{0.5 * sum(kl[-5:]) / len(kl[-5:]):.3g}")
PYEOF
)
    echo "target_kl=$TARGET" | tee "$OUT/target.txt"
    A=(kl.coef=0.05 "$S" "kl.adaptive.target_kl=$TARGET")
    run proportional "${A[@]}" kl.adaptive.type=proportional kl.adaptive.horizon=16
    run exponential "${A[@]}" kl.adaptive.type=exponential kl.adaptive.exp_factor=1.5 kl.adaptive.exp_decay=0.8
    run linear "${A[@]}" kl.adaptive.type=linear kl.adaptive.linear_factor=0.5
    run pid "${A[@]}" kl.adaptive.type=pid kl.adaptive.kp=1.0 kl.adaptive.ki=0.3 kl.adaptive.kd=0.1
    run schedule "${A[@]}" kl.adaptive.type=schedule kl.adaptive.schedule_type=linear kl.adaptive.final_coef=0.5 \
      kl.adaptive.schedule_steps="${STEPS:-10}"
    ;;
  entropy)
    A=(actor.lr=4e-5 "trainer.total_steps=${STEPS:-15}")
    [ -f "$OUT/unconstrained/metrics.jsonl" ] || run unconstrained "${A[@]}"  # the baseline does not depend on the bound
    run constrained "${A[@]}" constraints.entropy.bound="${BOUND:-0.6}" constraints.lagrangian_lr="${LAGRANGIAN_LR:-1.0}"
    ;;
  offpolicy)
    A=(rollout.partial_rollout=true rollout.partial_oversample=1.0 rollout.max_staleness=2 "trainer.total_steps=${STEPS:-10}")
    run gae_tis "${A[@]}" adv.estimator=gae rollout.is_mode=truncated
    run vtrace "${A[@]}" adv.estimator=vtrace adv.vtrace.rho_bar=1.0 adv.vtrace.c_bar=1.0
    ;;
  *) echo "unknown proof $KIND: kl | entropy | offpolicy" >&2; exit 2 ;;
esac
echo done
