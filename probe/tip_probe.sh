#!/usr/bin/env bash
# GPU probe: two SFT stages (register, dense) of a bigger tiny model side by side, then a short eval.
set -u
H="model.hidden_size=${H:-256} model.num_layers=${L:-4} model.num_heads=4 model.num_kv_heads=2 model.intermediate_size=$(( ${H:-256} * 4 ))"
S="sft.steps=${STEPS:-300} sft.batch_size=${B:-32} sft.check_every=${CHECK:-100} learner.lr=${LR:-3e-3} learner.device=${DEV:-cuda}"
mkdir -p $OUT/probe
( time python -m sliderl.cluster.cli sft configs/tip-sft.yaml output_dir=$OUT/probe/sft $H $S ) > $OUT/probe/sft.log 2>&1 &
( time python -m sliderl.cluster.cli sft configs/tip-sft.yaml kv=full data.task_solution=solution_dense output_dir=$OUT/probe/dense $H $S ) > $OUT/probe/dense.log 2>&1 &
wait
cat > $OUT/probe/eval.yaml <<YAML
task: {type: regmachine, num_variables: 4, repeats: [12, 16], max_operand: 5, num_registers: 32, lazy_registers: 32, lazy_spread: 26, seed: 0, train_size: 64, eval_size: 256}
warmstart: {enabled: false}
engine: {num_blocks: 8192, max_num_seqs: 128, device: ${DEV:-cuda}}
sampling: {max_tokens: 720}
monitor: {wandb: {mode: disabled}}
eval:
  num_problems: 64
  compare:
    k: 2
    temperature: 0.6
    top_p: 0.95
    seeds: [0]
    output_dir: $OUT/probe/eval
    entries:
      - {label: Dense, checkpoint: $OUT/probe/dense/model, kv: full}
      - {label: TIP-SFT, checkpoint: $OUT/probe/sft/model, kv: "registers:32"}
YAML
( time python -m sliderl.cluster.cli eval $OUT/probe/eval.yaml ) > $OUT/probe/eval.log 2>&1
grep -h "real\|sft:\|exact" $OUT/probe/sft.log $OUT/probe/dense.log; tail -n 12 $OUT/probe/eval.log
