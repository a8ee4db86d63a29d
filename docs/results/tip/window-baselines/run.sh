# Dense traces SFT-trained under a bounded window (issue 41: the eviction baselines trained for their budget):
# sliding_window:124 (TIP's peak live KV) and prefix_sliding:90 (the ~32-token prompt + 90 = TIP's peak), on the
# prologue task (the recipe's) and on task.answer=last, seeds 0-2; two at a time.
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1
jobs=()
for s in 0 1 2; do for v in prologue last; do for kv in sliding_window:124 prefix_sliding:90; do
  name=${kv%%:*}; jobs+=("$v/$name/s$s|$kv|$v|$s")
done; done; done
run() { IFS='|' read -r dir kv v s <<< "$1"; mkdir -p runs/tip-window/$dir
  .venv/bin/sliderl sft configs/tip-sft.yaml kv=$kv data.task_solution=solution_dense task.answer=$v \
    output_dir=runs/tip-window/$dir/sft model.seed=$s learner.seed=$s > runs/tip-window/$dir/sft.log 2>&1; }
for ((i = 0; i < ${#jobs[@]}; i += 2)); do run "${jobs[i]}" & run "${jobs[i+1]}" & wait; done
echo all done
