#!/usr/bin/env bash
# The H200 measurements of issues 36, 38, 39, 40 and 41, batched into device calls of at most 10 minutes each
# (a session has 30 minutes of device time, machine start included). Run from the repository root on the GPU
# machine, with the wheels installed as ../shared/tools/device-wheels.sh says; every item has its own time
# limit, writes its rows and log under $OUT/<item>/, and the call ends with one line per item (rc, seconds).
#
#   bash benchmarks/device_session.sh A    # ~8 min: restarts at batch 256 (39), PD's GPU test and scripted speedups (40)
#   bash benchmarks/device_session.sh B    # ~10 min: the 7B step with --offload cpu on one GPU (36; needs ~114 GiB of free host RAM)
#   bash benchmarks/device_session.sh C    # ~6 min: trained Pasta's realised speedup (41), PD's trained rows (40)
#   bash benchmarks/device_session.sh D    # ~9 min: h2o under CUDA graphs, its tests and speed (38.4); registers at the trained cadence (38.5)
#   bash benchmarks/device_session.sh K    # ~5 min: registers' pending kill, its GPU tests and speed at the trained
#                                          # cadence (38.5), h2o's ratio to PS (38.4), both through regress.py
#   bash benchmarks/device_session.sh KM   # ~9 min, one H200 (needs_h200): K, then M2's first row
#   bash benchmarks/device_session.sh R2   # ~8 min, one H200 (needs_h200): regress.py's 1.7B MFU headlines (38.1, 38.3)
#   bash benchmarks/device_session.sh E 1  # ~9 min: TIP's GPU-scale arms with decode wall time, seed 1 (41); carry .whl (Ray)
#   bash benchmarks/device_session.sh F    # ~10 min: the paper's Table 1 way at 8K, prefix_sliding (38.6); F2: full;
#                                          # F32: 32K, 16 sequences, prefix_sliding (~4 min); F32F: full (~10 min);
#                                          # F128: 128K, 4 sequences, prefix_sliding (~6-10 min)
#                                          # T: F32 and F32F in one H200 call (~9.5 min)
#   bash benchmarks/device_session.sh G    # ~10 min: the learner with compiled element-wise chains vs eager, 32K (38.3)
#   bash benchmarks/device_session.sh H    # ~9 min, one H200 (needs_h200): the 7B step with float32 masters, no offload (36); M's first row
#   bash benchmarks/device_session.sh M    # ~10 min: the 7B learner's MFU on one GPU, checkpointing all / compiled / 12 of 28 layers (38.3)
#   bash benchmarks/device_session.sh M2   # ~9 min, one H200 (needs_h200): the 7B whole-trace step's MFU, compiled (38.3)
#                                          # M2b: its second row alone (+ a profiled step); M2C: its first row, then C2
#   bash benchmarks/device_session.sh M2P  # ~7 min, any card: the 7B whole-trace step profiled, then 27 of 28 recomputed (38.3)
#   bash benchmarks/device_session.sh M26  # ~3 min on an H100: the 7B whole-trace step with 26 of 28 layers recomputed (38.3)
#   bash benchmarks/device_session.sh FX   # ~5 min, any card: FlexAttention's tiles at the 7B step's shape (38.3)
#   bash benchmarks/device_session.sh P2   # ~3 min: Pasta's realised speedup, fresh seeds 3-5 on the held-out slice (41;
#                                          # ran on an H100 at 77c96ce)
#   bash benchmarks/device_session.sh P    # ~9 min: batch 1 and 8 at 8K, cuBLAS/GEMV x plain/PDL, per-kernel split (38.2)
#   bash benchmarks/device_session.sh Q    # ~4 min: batch 1 cuBLAS vs GEMV after the MLP tail's change; batch-1 decode attention at 64 splits (38.2)
#   bash benchmarks/device_session.sh R    # ~10 min: regress.py on batch 1 and the learner (38.1)
#   bash benchmarks/device_session.sh X2   # ~10 min on nvidia-h200-x2: the sharded learner's 2-GPU rows (36)
#   bash benchmarks/device_session.sh X8   # ~10 min on an eight-GPU kind: 1.7B at 1-8 ranks, 7B at 4 and 8 (36)
#
# Order when a machine is lent (after the 2026-12-06 sessions: M2P, FX and M26 ran on an H100 in the fourth (the H200
# refused twelve times); F128, F32F, F32 and P2 ran on an H100 in the third,
# finishing Table 1 save full at 128K, which needs ~24 minutes, beyond one call; M2C and most of T ran on an H200 in
# the second, F2 on an H100 in the first; K and F on an H100 the day before; D, P and the first F before; G, H, M and
# most of Q earlier still, and B was refused by its host's 128 GiB): M2b (needs_h200), R (its learner item; batch 1
# ran), R2, C (its trained Pasta models under runs/pasta-h200 are not in this checkout:
# docs/results.md "Pasta" trains them, ~30 CPU minutes a seed), A, and X2 (X8) whenever a two-GPU (eight-GPU) machine
# is lent. One session holds 30 minutes of device time:
# three groups at most. B stays for a host with more than ~125 GiB free (the 7B float32-master step without offload is group H).
# Cards: H, M2 and M2b (18 of 28 layers recomputed), R2 and M's 12-layer row hold more than an H100's 79 GiB (call run
# with needs_h200; M2a's and M2P's 7B rows peak at 71 GiB and ran on an H100); every other group
# fits an H100, whose rows compare only with rows of the same card (regress.py says "other card" against an H200 record).
#
# carry: a Ray-less copy of .whl (runs/whl-light) for C (with runs/pasta-h200 and runs/pd-long), D, F, G, M, P, Q
# and R; for A, B, E, X2 and X8, which start Ray, a copy whose Ray wheel drops what sliderl never imports (the tree
# is ~17 MB now, Ray's wheel 47 MB, and everything carried must stay under 64 MiB):
#   mkdir -p runs/whl-e && cp .whl/*.whl runs/whl-e/ && (cd runs/whl-e && zip -q -d ray-*.whl 'ray/rllib/*' \
#     'ray/serve/*' 'ray/data/*' 'ray/llm/*' 'ray/train/*' 'ray/tune/*' 'ray/dashboard/client/build/*')   # 43 MB
#   mkdir -p runs/whl-light && cp .whl/*.whl runs/whl-light/ && rm runs/whl-light/ray-*.whl               # 4.5 MB
# and install the carried folder's wheels as ../shared/tools/device-wheels.sh says. The commands are the ones
# docs/results.md gives.
set -u
OUT=${OUT:?set OUT to the folder whose files come back}
group=${1:?name a group: A, B, C, D, E, F, F2, F32, F32F, F128, T, C2, G, H, K, KM, M, M2, M2a, M2b, M2C, M2P, M26, FX, P, P2, Q, R, R2, X2 or X8}
summary=()

item() {  # item NAME SECONDS COMMAND...: run with a limit, tee its log, note rc and seconds
  local name=$1 limit=$2
  shift 2
  mkdir -p "$OUT/$name"
  local start=$SECONDS
  timeout --signal=INT --kill-after=15 "$limit" "$@" 2>&1 | tee "$OUT/$name/log.txt" | tail -n 40
  local rc=${PIPESTATUS[0]}
  summary+=("$(printf '%-28s rc=%-4s %5ss' "$name" "$rc" "$((SECONDS - start))")")
}

export HF_HUB_OFFLINE=1
# KV pools sized on the H200's 139 GiB (118, 124 GiB); on a smaller card (the device lends H100s, 79 GiB, first) what
# it holds beside the 1.7B model (benchmarks/engine_gpu.py kv_gb_for); engine_gpu.py and restart_gpu.py do this
# themselves when --kv-gb is left out
kv() { python -c "import sys; from benchmarks.engine_gpu import card_kv_gb; print(card_kv_gb(float(sys.argv[1])))" "$1"; }
# items more than one group runs (each with its own time limit)
kill_items() {  # KILL_LIMIT: the pending kill's GPU tests, then registers:292 at the trained cadence and h2o beside PS
  item kill-gpu-tests 100 python -m pytest -q tests/test_engine_gpu.py tests/test_kernels.py -k "register or pending"
  item registers-cadence "$1" python benchmarks/regress.py --only registers292 h2o --record --out "$OUT/regress-kill"
}
table1_32k() {  # POLICY LIMIT BUDGET: 16 sequences of 32K from an empty cache (one item a policy)
  item "table1-32k-${1%%:*}" "$2" python benchmarks/engine_e2e.py --tokens 32768 --seqs 16 \
    --runs "$1@$(kv 118)@$3" --out "$OUT/table1-32k-${1%%:*}/engine_e2e.json"
}
table1_128k_ps() {  # LIMIT BUDGET: 4 sequences of 128K from an empty cache, prefix_sliding
  item table1-128k-ps "$1" python benchmarks/engine_e2e.py --tokens 131072 --seqs 4 \
    --runs "prefix_sliding:4096@$(kv 118)@$2" --out "$OUT/table1-128k-ps/engine_e2e.json"
}
pasta_realised() {  # C2's two items (~4.5 min): Pasta's realised batch-1 speedup, scripted and fresh seed 3 (carry runs/pasta-c2)
  item pasta-scripted 170 python benchmarks/pasta_speedup.py scripted --device cuda --problems 6 --repeats 3 \
    --num-chains 2 4 --num-steps 5 6 --out "$OUT/pasta-scripted/speedup.json"
  item pasta-fresh-s3 100 python benchmarks/pasta_speedup.py trained --device cuda --problems 6 --repeats 3 \
    --pasta-model runs/pasta-c2/s3/bonbon --baseline-model runs/pasta-c2/s3/base \
    --config runs/pasta-c2/s3/sft-config.yaml --out "$OUT/pasta-fresh-s3/bonbon.json"
}
pasta_heldout() {  # Pasta's realised batch-1 speedup, fresh seeds 3-5 on the held-out slice (task seed 1), ~2.5 min
  # (issue 41: the ab386c7 row timed seed 0's eval problems, the slice the recipe was chosen on); carry runs/pasta-c2
  for s in 3 4 5; do
    item "pasta-heldout-s$s" 110 python benchmarks/pasta_speedup.py trained --device cuda --problems 12 --repeats 3 \
      --task-seed 1 --pasta-model "runs/pasta-c2/s$s/bonbon" --baseline-model "runs/pasta-c2/s$s/base" \
      --config "runs/pasta-c2/s$s/sft-config.yaml" --out "$OUT/pasta-heldout-s$s/bonbon.json"
  done
}
mfu_7b_whole() {  # LIMIT [FLAG...]: the 7B whole-trace step, every layer recomputed, compiled (71 GiB: any card)
  local limit=$1
  shift
  item mfu-7b-full-comp "$limit" python benchmarks/learner_scaling.py --shape 7b --ranks 1 --seq 32768 --mode full \
    --prompt 128 --window 4096 --no-masters --compiled --steps 2 --out "$OUT/mfu-7b-full-comp" \
    --models /tmp/sliderl-models "$@"
}
mfu_7b_whole_ckpt() {  # K LIMIT [FLAG...]: the same with the first K of 28 layers recomputed (a kept layer holds
  local k=$1 limit=$2   # ~4.2 GiB, the last none (H100 rows, 2026-12-06): K = 18 needs_h200, ~108 GiB)
  shift 2
  item "mfu-7b-full-comp-ckpt$k" "$limit" python benchmarks/learner_scaling.py --shape 7b --ranks 1 --seq 32768 \
    --mode full --prompt 128 --window 4096 --no-masters --compiled --checkpoint-layers "$k" --steps 2 \
    --out "$OUT/mfu-7b-full-comp-ckpt$k" --models /tmp/sliderl-models "$@"
}
case "$group" in
  A)
    # issue 39: last_k at batch 256 on the engine with the run-ahead fix (8bd064b), beside PS in the same call
    item restarts-256 240 python benchmarks/restart_gpu.py --batches 256 --tokens 5000 --kv-gb "$(kv 124)" \
      --policies prefix_sliding:4096 last_k:4096:256 --out "$OUT/restarts-256"
    # issue 40: the denoise graphs against eager and the float64 reference, then the realised batch-1 speedups
    item pd-gpu-test 60 python -m pytest -q tests/test_pd_attention.py -m gpu
    item pd-scripted 150 python benchmarks/planned_diffusion_speedup.py scripted --device cuda --problems 6 \
      --repeats 3 --knobs 1.0 0.5 0.25 0.125 --out "$OUT/pd-scripted/pd_speedup_scripted.json"
    # (the trained PD models' rows need ~140 s more than a call has left here: group C runs them)
    ;;
  B)
    # issue 36: one H200 holds 7B's float32 masters only with the optimizer state in host memory (128 GiB here);
    # the gradients go to the host once a step (learner.gradient_sync: step; 30 GB of float32 gradients on the GPU
    # in between) instead of once per 32K micro-batch (8 copies of 30 GB and 8 host-side adds over 7.6B floats)
    item scaling-7b-offload 570 python benchmarks/learner_scaling.py --shape 7b --ranks 1 --seq 32768 \
      --offload cpu --gradient-sync step --steps 2 --out "$OUT/scaling-7b-offload" --models /tmp/sliderl-models
    ;;
  H)
    # issue 36 on one H200 (needs_h200: the state alone is 113.6 GiB): the 7B step with float32 masters and no
    # offload (group B's host offload does not fit a 128 GiB host: 28.4 GiB of float32 shards + 85.1 GiB of
    # gradients and AdamW state, learner.offload's check refused it on the H100 machine, 68.7 GiB available), FSDP2
    # on one rank (bf16 compute, float32 masters, AdamW one parameter at a time); truncated at T = 32K as M's rows,
    # compiled element-wise chains. Then the compiled-path GPU test (its inputs were on the CPU at 82be973) and
    # M's first row (no masters, every layer recomputed, eager)
    item scaling-7b-masters 300 python benchmarks/learner_scaling.py --shape 7b --ranks 1 --seq 32768 --fsdp always \
      --mode truncated --window 4096 --prompt 128 --micro-batch-tokens 16512 --compiled --steps 2 \
      --out "$OUT/scaling-7b-masters" --models /tmp/sliderl-models
    item compile-gpu-test 60 python -m pytest -q tests/test_compile_elementwise.py -m gpu
    item mfu-7b 180 python benchmarks/learner_scaling.py --shape 7b --ranks 1 --seq 32768 --mode truncated \
      --window 4096 --prompt 128 --no-masters --micro-batch-tokens 16512 --steps 2 --out "$OUT/mfu-7b" \
      --models /tmp/sliderl-models
    ;;
  C)
    # issue 41: the trained Pasta models' realised batch-1 speedup (Pasta-BoNBoN and Pasta-SFT vs Baseline-SFT,
    # the fresh seeds 3-5 of docs/results.md "Pasta"); carry runs/pasta-h200 (their model folders, 11 MB)
    for s in 3 4 5; do
      item pasta-realised-s$s 100 python benchmarks/pasta_speedup.py trained --device cuda --problems 6 --repeats 3 \
        --pasta-model runs/pasta-h200/s$s/bonbon/model --baseline-model runs/pasta-h200/s$s/base/model \
        --out "$OUT/pasta-realised-s$s/bonbon.json"
    done
    # issue 40: the trained PD models' speedups with the denoise graphs (A's last item, alone)
    item pd-trained 300 python benchmarks/planned_diffusion_speedup.py trained --runs runs/pd-long --device cuda \
      --problems 64 --latency-problems 8 --repeats 3 --knobs 0.5 1.0 0.25 0.125 0.5:0.9 0.25:0.9 0.5:uniform \
      --out "$OUT/pd-trained/pd_speedup_trained.json"
    ;;
  C2)
    # issue 38, item 7 in ~4 min: Pasta's realised batch-1 speedup after items 1 and 2's changes, scripted at the 1.7B
    # shape (random weights, the task's problems scripted into Pasta's layout), then one trained pair: fresh seed 3
    # (Pasta-BoNBoN step 30 vs Baseline-SFT), retrained on the CPU in 391 s at 0f25a2f (OMP_NUM_THREADS=1 python
    # benchmarks/pasta_seeds.py --seeds 3 --out runs/pasta-fresh --eval task.seed=1). These are not the models of the
    # realised 1.138x at ab386c7 (training's float order changed between the commits: docs/results.md "Pasta"), so
    # compare realised / theoretical on the same problems (0.95 for seed 3 then), not the speedup. Carried as
    # runs/pasta-c2 (7 MB):
    #   mkdir -p runs/pasta-c2/s3 && cp -r runs/pasta-fresh/s3/bonbon/checkpoints/step_000030 runs/pasta-c2/s3/bonbon
    #   && cp -r runs/pasta-fresh/s3/base/model runs/pasta-c2/s3/base && cp runs/pasta-fresh/s3/sft/config.yaml
    #   runs/pasta-c2/s3/sft-config.yaml
    pasta_realised
    ;;
  D)
    # issue 38, item 4: h2o decodes from CUDA graphs (its page mass in the graphs' static buffer, one pass over the
    # keys): the GPU tests (graphs vs eager vs the CPU reference), then h2o against prefix_sliding at equal live KV
    # (33 tests pass in 145 s on an H100; at 150 s the item was cut in pytest's closing garbage collection)
    item h2o-gpu-tests 200 python -m pytest -q tests/test_h2o.py tests/test_engine_gpu.py tests/test_kernels.py -m gpu
    item h2o-vs-ps 200 python benchmarks/engine_gpu.py --positions 32768 131072 --policies h2o:4096 \
      prefix_sliding:4096 --hf-batch 0 --steps 100 --warmup 40 --out "$OUT/h2o-vs-ps/engine_gpu.json"
    # issue 38, item 5: registers at the trained TIP model's kill cadence (a register every 14 tokens,
    # docs/results/engine/register-cadence.json), at equal live KV: 4,096 / 14 = 292 registers
    item registers-cadence 200 python benchmarks/engine_gpu.py --positions 131072 --policies prefix_sliding:4096 \
      registers:292 --step-tokens 14 --hf-batch 0 --steps 100 --warmup 40 --out "$OUT/registers-cadence/engine_gpu.json"
    ;;
  K)
    # issue 38, item 5 after the pending kill (a decode step queued before its register token was read back masks the
    # killed step in the decode kernel, kernels.metadata.register_kills; before, that row ran a second forward, 3.7 ms
    # of a 25.3 ms step at the trained cadence: 0.864x PS on an H100, docs/results.md): its GPU tests (graphs vs
    # the CPU path, the kernel against the dense reference), then registers:292 at the trained cadence beside PS
    # (through regress.py: the row beside PS, and the ratio against its record; 240 s: at 170 both runs finished and
    # the script was cut naming the card, 2026-12-05, H100)
    kill_items 240
    ;;
  KM)
    # K's two items, then M2's first row (7B whole trace, every layer recomputed, compiled): one H200 call of ~9 min
    # (needs_h200) for a session that cannot spend a call on each
    kill_items 230
    mfu_7b_whole 250
    ;;
  R2)
    # issue 38, item 1: regress.py's MFU headlines (1.7B whole and truncated, compiled, no recomputation; recorded
    # on an H200 at 9491d1c: the 1.7B whole-trace row needs ~89 GiB, so needs_h200)
    item regress-mfu 560 python benchmarks/regress.py --only mfu.1p7b --record --out "$OUT/regress-mfu"
    ;;
  E)
    # issue 41, TIP: the GPU-scale recipe's arms with their decode wall time on the H200 (summary.md's "decode s"),
    # one seed a call: `E` is seed 0 (measured at 4ae9f64), `E 1` and `E 2` the other two (measured at 1bbeb04:
    # docs/results/tip/h200-3-seeds)
    # (the GPU machine's Python has no wandb: the run logs to its own files only). With seeds 1 and 2 back, the
    # table over the three: seed 0's rows are its over-seeds/results.jsonl (one seed: the same records), so
    #   D=docs/results/tip/h200-3-seeds; mkdir -p $D/s0/eval && cp docs/results/tip/h200-wall-4ae9f64/over-seeds/results.jsonl $D/s0/eval/
    #   (and each call's $OUT/tip/s1 and $OUT/tip/s2 eval/ folders to $D/s1/eval, $D/s2/eval), then
    #   python benchmarks/tip_seeds.py --recipe tip-gpu --seeds 0 1 2 --out $D --report-only
    seed=${2:-0}
    item tip-gpu-s$seed 575 python benchmarks/tip_seeds.py --recipe tip-gpu --device cuda --seeds "$seed" --out "$OUT/tip" \
      --grpo-seconds 110 --sft sft.max_seconds=150 --train monitor.wandb.mode=disabled eval.before=false eval.after=false
    ;;
  F)
    # issue 38, item 6: the Prefix Sliding paper's Figure 6 / Table 1 as the paper measures it — every sequence
    # generated from an empty cache, tok/s averaged over the whole generation — at 8K (256 sequences: 1,024 x 8K
    # is ~18 minutes for prefix_sliding alone, past a call's 10; 32K and 128K are hours at any batch that the
    # comparison means). "finished": false in a row says the run hit its budget first
    # (both in one call did not finish on an H100, 2026-12-05: PS had 1.87M of the 2.10M tokens at 250 s, full
    # 1.61M at 300 s after 231 preemptions; so one policy a call: F prefix_sliding, F2 full)
    item table1-8k-ps 580 python benchmarks/engine_e2e.py --tokens 8192 --seqs 256 \
      --runs "prefix_sliding:4096@$(kv 118)@520" --out "$OUT/table1-8k-ps/engine_e2e.json"
    ;;
  F2)
    item table1-8k-full 590 python benchmarks/engine_e2e.py --tokens 8192 --seqs 256 \
      --runs "full@$(kv 118)@560" --out "$OUT/table1-8k-full/engine_e2e.json"
    ;;
  F32)
    # the same at 32K with 16 sequences (0.52M tokens), prefix_sliding: finished in 155 s on an H100 (77c96ce)
    table1_32k prefix_sliding:4096 300 260
    ;;
  F32F)
    # full at 32K, 16 sequences (its 16 x 32K of KV, 60 GB, is what an H100's pool holds): finished in 402 s on an
    # H100 (77c96ce)
    table1_32k full 590 545
    ;;
  F128)
    # 128K with 4 sequences, prefix_sliding alone: finished in 386 s on an H100 (77c96ce); full at 128K reads 15 GB
    # of KV a sequence by the end: ~24 minutes for 4 sequences, past any call
    table1_128k_ps 590 545
    ;;
  T)
    # both 32K rows in one H200 call with budgets that finish (PS ~2.1 min, full ~4.8 with the tail; model loads ~20 s
    # each). Its first version (2314325) gave PS 120 s and full 240 inside a 390 s item and was cut before full printed
    table1_32k prefix_sliding:4096 185 145
    table1_32k full 385 330
    ;;
  G)
    # issue 38, item 3: the learner's element-wise chains compiled (learner.compile_elementwise; eager they were
    # 28% of the truncated 32K step's device time), each row beside its eager twin; the GPU test of the same path
    item compile-gpu-test 90 python -m pytest -q tests/test_compile_elementwise.py -m gpu
    # (rows run in this order, checkpointed first; the budget skips the rows that would start too late. Without
    # checkpointing the 1.7B step fits the H200 too: 69.8 GiB truncated, 123.5 GiB whole at 32K, eager)
    item learner-compiled 480 python benchmarks/learner_gpu.py --lengths 32768 --no-peer --compiled both --steps 2 \
      --rows sliderl:truncated:ckpt:32768 sliderl:truncated:ckpt:32768:compiled sliderl:full:ckpt:32768 \
      sliderl:full:ckpt:32768:compiled sliderl:truncated:nockpt:32768:compiled sliderl:full:nockpt:32768:compiled \
      --budget-s 470 --out "$OUT/learner-compiled"
    ;;
  M)
    # issue 38, item 3 at the 7B shape (target: >= 45% MFU): one H200, AdamW on the bf16 weights (8 B/param, 61 GB of
    # state: float32 masters need offload, group B), truncated T = 32K (W 4,096, k 4, prompt 128: the 1.7B rows'
    # shape), one window per micro-batch; every layer recomputed, eager, then compiled, then with 16 of the 28
    # layers keeping their activations (compiled: 2.33 GiB a layer at 16,512 tokens, 37 GiB for 16, counted on the
    # CPU by benchmarks/activation_memory.py; eager 3.47), beside ~71 GiB for the step with every layer recomputed.
    # An OOM row says so in its status. The 7B is built once on the CPU under /tmp (not $OUT: 15 GB)
    # (the first row builds the model: ~1-2 min of the 250 s)
    limit=250
    for variant in "" "--compiled" "--compiled --checkpoint-layers 12"; do
      name=mfu-7b$(echo "$variant" | tr -d ' -' | sed 's/compiled/-comp/; s/checkpointlayers/-ckpt/')
      # shellcheck disable=SC2086  # the variant's flags are words
      item "$name" $limit python benchmarks/learner_scaling.py --shape 7b --ranks 1 --seq 32768 --mode truncated \
        --window 4096 --prompt 128 --no-masters --micro-batch-tokens 16512 --steps 2 $variant \
        --out "$OUT/mfu-7b" --models /tmp/sliderl-models
      limit=150
    done
    ;;
  M2)
    # issue 38, item 3: the 7B whole-trace step (8 traces of 32K, one a micro-batch; target >= 45% MFU), one H200
    # (needs_h200), AdamW on the bf16 weights, compiled: every layer recomputed, then 18 of 28 (the 10 kept hold
    # ~47 GiB at 148 KiB a token beside 57 GiB of state). The truncated rows ran on 2026-12-05 (docs/results.md)
    mfu_7b_whole 250
    mfu_7b_whole_ckpt 18 250
    ;;
  M2a)
    # M2's first row alone (~3 min; its 71 GiB fit an H100 too)
    mfu_7b_whole 300
    ;;
  M2b)
    # M2's second row alone (~5.5 min with the 7B built, needs_h200), then one more step under torch.profiler: every
    # layer recomputed ran at 2314325 (44.5%)
    mfu_7b_whole_ckpt 18 400 --profile
    ;;
  M2P)
    # issue 38, item 3 on any card (~7 min on an H100): where the 7B whole-trace step's time goes (every layer
    # recomputed, one more step under torch.profiler: GEMMs, attention, compiled element-wise, optimizer), then the
    # one kept layer an H100's 79 GiB holds beside its 71 (27 of 28 recomputed; expandable segments against
    # fragmentation)
    mfu_7b_whole 330 --profile
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True mfu_7b_whole_ckpt 27 220
    ;;
  M26)
    # issue 38, item 3 on an H100 (~3 min): 26 of 28 layers recomputed, the second kept layer's memory and time
    # beside M2P's 27 (expandable segments: ~76 of the H100's 79 GiB)
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True mfu_7b_whole_ckpt 26 220
    ;;
  FX)
    # issue 38, item 3 (~5 min, any card): FlexAttention's forward and backward at the 7B step's shape (one whole
    # trace of 32K, prefix_sliding:4096, 28/4 heads of 128), under its defaults and other tiles
    # (the 7B step's backward ran at 183 TFLOP/s on an H100, half its forward's rate); then the profile's GPU test
    item flex-7b 300 python benchmarks/flex_attention.py --tokens 32768 --prompt 128 --window 4096 --heads 28 \
      --kv-heads 4 --out "$OUT/flex-7b" --configs default bwd_num_stages=2 \
      bwd_BLOCK_M1=64,bwd_BLOCK_N1=64,bwd_BLOCK_M2=64,bwd_BLOCK_N2=64,bwd_num_warps=4 \
      bwd_BLOCK_M1=32,bwd_BLOCK_N1=128,bwd_BLOCK_M2=128,bwd_BLOCK_N2=32,bwd_num_warps=4 \
      bwd_BLOCK_M1=64,bwd_BLOCK_N1=128,bwd_BLOCK_M2=128,bwd_BLOCK_N2=64,bwd_num_stages=2,bwd_num_warps=4 \
      fwd_BLOCK_N=128,fwd_num_stages=2
    item profile-gpu-test 60 python -m pytest -q -p no:cacheprovider tests/test_benchmarks_smoke.py -m gpu \
      -k compiled_graph
    ;;
  P2)
    # Pasta's held-out realised speedup (~3 min, any card; carry runs/pasta-c2: seeds 3-5, each made as C2 says for
    # seed 3; 4 and 5 trained by its command with --seeds 4 and --seeds 5 on 2026-12-06)
    pasta_heldout
    ;;
  M2C)
    # M2's first row and C2 in one call (~9.5 min, needs_h200, carry runs/pasta-c2 too; ran at 2314325)
    mfu_7b_whole 300
    pasta_realised
    ;;
  P)
    # issue 38, item 2: small-batch decode at 8K (target: batch 1 >= 760 tok/s, >= 80% of the byte limit at 2-8),
    # each row with the GPU's ms per step by kernel (torch.profiler over 32 steps, graphs included). First the GPU
    # tests of the PDL chain (bit-equal tokens, every captured launch chained, the PTX's wait and prefetch), then
    # per batch: cuBLAS vs the Triton GEMV (whose MLP tail is one launch), each launched plainly and as a PDL chain
    # (at 4ae9f64 the engine with gemv on decoded 20 tok/s, 49 ms a step in _gemv_kernel; the likely cause, the MLP
    # tail's register spill at its 16 x 512 tile, is fixed since: the per-layer GEMV table, the tail included, first)
    item gemv-layers 90 python benchmarks/gemv.py --m 1 8
    item pdl-gpu-tests 120 python -m pytest -q tests/test_engine_gpu.py tests/test_gemv.py -m gpu -k "pdl or gemv"
    # (batch 1 also splits the overlapped step's host time by phase and by function: with the GPU faster, the host's
    # ~2 ms of launching a step and sampling its token is what the step would wait on)
    item batch1-8k 220 python benchmarks/engine_gpu.py --positions 8192 --policies prefix_sliding:4096 --max-seqs 1 \
      --hf-batch 0 --steps 64 --profile 32 --phases 32 --host-profile 32 --gemv off on --pdl off on \
      --out "$OUT/batch1-8k/engine_gpu.json"
    item batch8-8k 200 python benchmarks/engine_gpu.py --positions 8192 --policies prefix_sliding:4096 --max-seqs 8 \
      --hf-batch 0 --steps 64 --profile 32 --gemv off on --pdl off on --out "$OUT/batch8-8k/engine_gpu.json"
    ;;
  Q)
    # issue 38, item 2 (~4 min). Measured at 1bbeb04 (docs/results/engine/batch1-gemv-1bbeb04): the GEMV's spill fix
    # (20 -> 233 tok/s), its fused MLP tail still 92 us against torch's 16.6; the offload and fused-path GPU tests
    # passed. Left: batch 1 with the GEMV path's tail as silu_mul + the plain down GEMV (changed since), beside cuBLAS;
    # then the batch-1 decode attention at more, smaller splits than the default 16 x 128-key tiles (14.0 us a layer,
    # ~1.2 TB/s; 16 and 32 splits were swept at 1bbeb04)
    item gemv-layers-m1 60 python benchmarks/gemv.py --m 1
    item batch1-gemv 120 python benchmarks/engine_gpu.py --positions 8192 --policies prefix_sliding:4096 --max-seqs 1 \
      --hf-batch 0 --steps 32 --profile 8 --gemv off on --out "$OUT/batch1-gemv/engine_gpu.json"
    item decode-sweep-b1 150 python benchmarks/kernel_decode.py --sweep --batch 1 --window 4096 --pos 8192 \
      --sweep-splits 64 --no-flex --no-sdpa --out "$OUT/decode-sweep-b1/kernel_decode.json"
    ;;
  R)
    # issue 38, item 1: benchmarks/regress.py's headlines that have not yet been compared on the GPU, batch 1 (its
    # last run was cut at 110 s) and the learner's two 32K rows; each prints recorded vs measured with a verdict
    item regress-batch1 240 python benchmarks/regress.py --only batch1 --record --out "$OUT/regress-batch1"
    item regress-learner 330 python benchmarks/regress.py --only learner --record --out "$OUT/regress-learner"
    ;;
  X2)
    # issue 36 on a two-GPU machine (kind nvidia-h200-x2; carry .whl, as B): 1.7B at 1 and 2 ranks at the same global
    # batch with the weight sync's time, then the 7B step at 2 ranks without offload (docs/results.md, "A sharded
    # learner"); rows print as each finishes
    item scaling-1p7b 300 python benchmarks/learner_scaling.py --shape 1.7b --ranks 1 2 --seq 8192 32768 --sync \
      --out "$OUT/scaling-1p7b" --models /tmp/sliderl-models
    item scaling-7b-2gpu 280 python benchmarks/learner_scaling.py --shape 7b --ranks 2 --seq 32768 \
      --out "$OUT/scaling-7b-2gpu" --models /tmp/sliderl-models
    ;;
  X8)
    # issue 36 on an eight-GPU machine (kind nvidia-h100-x8 or nvidia-h200-x8; carry .whl): 1.7B from 1 to 8 ranks at
    # the same global batch (4 groups of 8 traces), the 7B step at 4 and 8 ranks, and 8 ranks as 2 copies of 4 (HSDP)
    item scaling-1p7b-x8 220 python benchmarks/learner_scaling.py --shape 1.7b --ranks 1 2 4 8 --seq 32768 --groups 4 \
      --sync --out "$OUT/scaling-1p7b-x8" --models /tmp/sliderl-models
    item scaling-7b-x8 220 python benchmarks/learner_scaling.py --shape 7b --ranks 4 8 --seq 32768 --groups 2 \
      --out "$OUT/scaling-7b-x8" --models /tmp/sliderl-models
    item scaling-7b-hsdp 150 python benchmarks/learner_scaling.py --shape 7b --ranks 8 --shard-ranks 4 --seq 32768 \
      --groups 2 --out "$OUT/scaling-7b-hsdp" --models /tmp/sliderl-models
    ;;
  *)
    echo "unknown group $group: A, B, C, D, E, F, F2, F32, F128, G, H, K, M, M2, P, Q, R, R2, X2 or X8" >&2
    exit 2
    ;;
esac
printf '%s\n' "${summary[@]}" | tee "$OUT/summary-$group.txt"
