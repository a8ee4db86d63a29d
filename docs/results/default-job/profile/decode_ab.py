"""The CPU engine's decode speed on the default job's warm-started model: batch 32 of the task's train prompts,
temperature 1 (a fixed seed), one torch thread; best and median of 5 generations, and a hash of the greedy tokens.
Run from a checkout's root (``python docs/results/default-job/profile/decode_ab.py MODEL``) in two checkouts to
compare commits on the same model and prompts."""
import hashlib
import sys
import time

import torch

torch.set_num_threads(1)
from sliderl.rollout import LLM, SamplingParams  # noqa: E402
from sliderl.tasks.arith import ArithTask  # noqa: E402

model = sys.argv[1]
llm = LLM(model, kv="prefix_sliding:24", block_size=16, num_blocks=2048, max_num_seqs=64, max_num_batched_tokens=512)
task = ArithTask(num_steps=(8, 12), max_operand=9, min_value=10, max_value=99, seed=0)
prompts = [llm.tokenizer(p["prompt"]).input_ids for p in task.problems(32)]
params = SamplingParams(max_tokens=128, temperature=1.0, seed=1)
llm.generate(prompts, params)
times = []
for _ in range(5):
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    times.append(time.perf_counter() - t0)
n = sum(len(o.token_ids) for o in outs)
greedy = llm.generate(prompts, SamplingParams(max_tokens=128, temperature=0))
digest = hashlib.md5(str([o.token_ids for o in greedy]).encode()).hexdigest()[:12]
print(f"tokens {n} best {min(times):.3f} s {n / min(times):.0f} tok/s median {sorted(times)[2]:.3f} s "
      f"{n / sorted(times)[2]:.0f} tok/s greedy {digest}")
