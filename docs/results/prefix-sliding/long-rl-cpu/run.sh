#!/usr/bin/env bash
# Long-trace RL on CPU (issue 41): truncated vs whole-trace GRPO under prefix_sliding:12 on 12-14-step chains
# (traces 109-123 tokens, >= 9 W), 2 seeds, from each seed's own warm start (held-out exact match 0.4 target).
set -u
cd /work/main
export HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 HOME=/tmp/ltrhome
mkdir -p runs/ltr $HOME
common="task.num_steps=[12,14] engine.kv=prefix_sliding:12 sampling.max_tokens=160 warmstart.sft.target_accuracy=0.2 monitor.include_dashboard=false"
arm() {  # arm seed window_mode
  .venv/bin/sliderl train configs/tiny-arith.yaml run_dir=runs/ltr/$1-s$2 $common learner.window_mode=$3 \
      train.seed=$2 learner.seed=$2 model.seed=$2 > runs/ltr/$1-s$2.log 2>&1
  echo "$1-s$2 rc $? $(date +%T)"
}
for pair in "trunc truncated" "whole full"; do
  set -- $pair
  arm $1 0 $2 & arm $1 1 $2 & wait
done
