#!/usr/bin/env bash
# Long-trace RL on CPU at matched wall time (issue 41): the truncated arm of ../long-rl-cpu/ given the whole arm's wall
# time there (steps 120 x 6m23s / 5m06s = 150 for seed 0, 120 x 6m24s / 4m10s = 184 for seed 1), then the whole arm
# again at the same commit from the same cached warm start (these warm starts differ from 4b4dd4f's: the eval-before
# accuracies are 0.234 and 0.363 here, 0.402 and 0.273 there). Each pair two at a time on the 2-core machine.
set -u
export HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 HOME=/tmp/ltrhome
L=docs/results/prefix-sliding/long-rl-cpu
mkdir -p $HOME runs/ltr2
arm() {  # name config steps
  .venv/bin/sliderl train $2 run_dir=runs/ltr2/$1 train.steps=$3 > runs/ltr2/$1.log 2>&1
  echo "$1 rc $? $(date +%T)"
}
arm trunc-time-s0 $L/trunc-s0/config.yaml 150 & arm trunc-time-s1 $L/trunc-s1/config.yaml 184 & wait
arm whole-s0 $L/whole-s0/config.yaml 120 & arm whole-s1 $L/whole-s1/config.yaml 120 & wait
python docs/results/prefix-sliding/long-rl-cpu-time-matched/plot.py
