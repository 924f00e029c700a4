#!/bin/bash
# GRPO quality sweep on one GPU inside one lease call of known length, in two phases (bench/quality/rl_sweep.py):
#   phase 1: 12 jobs of 300 steps (lr 1e-4 / 2e-4 / 3e-4 × seeds 0-2, and lr 3e-4 + kl_beta 0.04 × seeds 0-2;
#            16 prompts × 8 answers a step, rl.max_new_tokens 8, the four weakest families), all at once;
#   phase 2: the same 12 settings with as many steps (a multiple of 100) as the rest of BUDGET_S allows, taking
#            phase 1's whole wall time (start-up and evaluation included) as 300 steps' worth: a safe estimate.
# Results: OUT/p1_results.jsonl, OUT/p2_results.jsonl, OUT/sweep_logs.tgz.
#   bash bench/quality/rl_gpu_sweep.sh RUN OUT BUDGET_S
RUN=$1; OUT=$2; BUDGET=$3; START=$(date +%s)
jobs() {
python3 - "$1" "$2" <<'EOF'
import json, sys
tag, steps = sys.argv[1], int(sys.argv[2])
jobs = [{"name": f"{tag}-lr{lr:g}-s{s}", "set": {"rl.lr": lr, "rl.seed": s}} for lr in (1e-4, 2e-4, 3e-4) for s in (0, 1, 2)]
jobs += [{"name": f"{tag}-lr3e-4-kl0.04-s{s}", "set": {"rl.lr": 3e-4, "rl.seed": s, "rl.kl_beta": 0.04}} for s in (0, 1, 2)]
for j in jobs:
    j["set"].update({"rl.batch_size": 16, "rl.max_steps": steps, "rl.max_new_tokens": 8, "rl.log_every": max(steps // 20, 1)})
print(json.dumps(jobs))
EOF
}
left() { echo $(( BUDGET - ($(date +%s) - START) )); }
T=$(date +%s)
timeout $(( $(left) - 10 )) python3 -m bench.quality.rl_sweep "$RUN" /tmp/sweep/p1 "$(jobs p1 300)"
W1=$(( $(date +%s) - T )); echo "phase 1 wall ${W1}s"
cp /tmp/sweep/p1/results.jsonl "$OUT/p1_results.jsonl"
R=$(( $(left) - 30 ))
N=$(( R * 300 / W1 / 100 * 100 ))
echo "phase 2: ${R}s left -> ${N} steps"
if [ "$N" -ge 800 ]; then
  timeout $(( $(left) - 10 )) python3 -m bench.quality.rl_sweep "$RUN" /tmp/sweep/p2 "$(jobs p2 $N)"
  cp /tmp/sweep/p2/results.jsonl "$OUT/p2_results.jsonl"
fi
tar czf "$OUT/sweep_logs.tgz" -C /tmp/sweep .
python3 - "$OUT" <<'EOF'
import json, sys, glob
for f in sorted(glob.glob(sys.argv[1] + "/p*_results.jsonl")):
    for l in open(f):
        d = json.loads(l)
        print(f"{d['name']:24s} steps {d['steps']} {d['train_s']:6.0f}s  weak min {d['min_before']:.3f}->{d['min_after']:.3f} "
              f"mean {d['mean_before']:.3f}->{d['mean_after']:.3f}  all {d['all_mean_sft']:.3f}(sft) {d['all_mean_before']:.3f}->"
              f"{d['all_mean_after']:.3f}  stage_eval {d['stage_eval']['exact_match']}  "
              + " ".join(f"{k}={v:.3f}" for k, v in d["after"].items()))
EOF
