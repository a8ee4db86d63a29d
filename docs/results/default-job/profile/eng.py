import time, json, sys, torch, cProfile, pstats
torch.set_num_threads(1)
from sliderl.rollout import LLM, SamplingParams
from transformers import AutoTokenizer
path = "/root/.cache/sliderl/warmstart/sft-04bf97d45315"
tok = AutoTokenizer.from_pretrained(path)
probs = [json.loads(l) for l in open("/tmp/prof/rl-ts/data/train.jsonl")][:64]
prompts = [tok(p["prompt"]).input_ids for p in probs]
llm = LLM(path, kv="prefix_sliding:24", block_size=16, num_blocks=2048, max_num_seqs=64, max_num_batched_tokens=512)
params = SamplingParams(max_tokens=128, temperature=1.0)
llm.generate(prompts[:8], params)
B = int(sys.argv[1]) if len(sys.argv) > 1 else 32
ps = [prompts[i % 64] for i in range(B)]
t0 = time.perf_counter(); outs = llm.generate(ps, params); dt = time.perf_counter() - t0
n = sum(len(o.token_ids) for o in outs)
print(f"B={B} tokens {n} {dt:.2f}s {n/dt:.0f} tok/s")
pr = cProfile.Profile(); pr.enable(); llm.generate(ps, params); pr.disable()
pstats.Stats(pr).sort_stats("tottime").print_stats(25)
