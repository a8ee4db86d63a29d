"""End-to-end generation throughput: the real path from prompts, against the steady state at the same batch.

    python benchmarks/engine_e2e.py --tokens 8192 --seqs 256 --runs prefix_sliding:4096@118 full@118 \
        [--budget-s 280] [--reference] [--out F]

Each run ``POLICY@KV_GB[@BUDGET_S]`` (its own time budget, else ``--budget-s``) builds an engine (Qwen3-1.7B config, random bf16 weights, CUDA graphs) with
a KV pool of KV_GB GiB, adds ``--seqs`` requests of 100 random prompt tokens each asking for
``--tokens`` tokens (temperature 1, ``ignore_eos``) through ``LLM.add_request`` and steps it until
every request is done or ``--budget-s`` has passed. Reported: average generated tok/s over the run,
tok/s over its last quarter (the time it took to generate the last 25% of the tokens it generated),
preemptions, the engine's admitted concurrency, and the rate in each eighth of the run. With
``--reference``, ``benchmarks/engine_gpu.py``'s steady-state decode rate at position ``--tokens``
with the run's batch is measured in the same process as the reference (the Prefix Sliding paper's
Table 1 compares the same two things: generation from prompts vs the synthesised steady state).
``--cpu-smoke`` runs a tiny model on the CPU: a check of the script, not a measurement.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from sliderl.rollout import LLM, SamplingParams  # noqa: E402

PROMPT = 100


def generated(seqs) -> int:
    return sum(len(s.token_ids) - s.prompt_len for s in seqs)


def run(path: Path, spec: str, kv_gb: float, seqs: int, tokens: int, budget_s: float, device: str, dtype: str,
        seed: int = 0) -> dict:
    """One end-to-end generation; the engine is closed afterwards (its pool and graphs freed)."""
    llm = LLM(str(path), kv=spec, device=device, dtype=dtype, block_size=16, max_num_seqs=seqs, kv_cache_gb=kv_gb,
              max_model_len=PROMPT + tokens + 16)
    vocab = min(llm.model.config.vocab_size, 32000)
    gen = torch.Generator().manual_seed(seed)
    requests = [llm.add_request(torch.randint(1000 % vocab, vocab, (PROMPT,), generator=gen).tolist(),
                                SamplingParams(max_tokens=tokens, temperature=1.0, ignore_eos=True, seed=seed + i))
                for i in range(seqs)]
    samples = [(0.0, 0)]  # (seconds since start, tokens generated so far)
    concurrency = 0
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    step = 0
    while llm.scheduler.has_unfinished() and time.perf_counter() - start < budget_s:
        llm.step()
        step += 1
        concurrency = max(concurrency, len(llm.scheduler.running))
        if step % 16 == 0:
            samples.append((time.perf_counter() - start, generated(requests)))
    if device == "cuda":
        torch.cuda.synchronize()
    samples.append((time.perf_counter() - start, generated(requests)))
    total_s, total = samples[-1]
    eighths = [_rate(samples, total * k / 8, total * (k + 1) / 8) for k in range(8)]
    row = {"policy": spec, "kv_cache_gb": kv_gb, "seqs": seqs, "tokens": tokens, "finished": not llm.scheduler.has_unfinished(),
           "seconds": total_s, "generated": total, "tokens_per_s": total / total_s,
           "last_quarter_tokens_per_s": _rate(samples, 0.75 * total, total),
           "preemptions": llm.stats.preemptions, "max_running": concurrency,
           "admitted_concurrency": llm.max_concurrency(PROMPT, tokens),
           "rate_by_eighth": eighths, "num_blocks": llm.scheduler.blocks.num_blocks}
    llm.close()
    del llm, requests
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return row


def _rate(samples, lo: float, hi: float) -> float:
    """tok/s between the moments the cumulative count reached ``lo`` and ``hi`` (linear between samples)."""
    return (hi - lo) / max(_time_at(samples, hi) - _time_at(samples, lo), 1e-9)


def _time_at(samples, n: float) -> float:
    for (t0, n0), (t1, n1) in zip(samples, samples[1:]):
        if n1 >= n:
            return t0 + (t1 - t0) * (n - n0) / max(n1 - n0, 1)
    return samples[-1][0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", nargs="+", default=["prefix_sliding:4096@118", "prefix_sliding:4096@110", "full@118"])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--seqs", type=int, default=256)
    parser.add_argument("--budget-s", type=float, default=280.0)
    parser.add_argument("--reference", action="store_true", help="steady-state rate at the same batch (engine_gpu.py)")
    parser.add_argument("--reference-steps", type=int, default=48)
    parser.add_argument("--cpu-smoke", action="store_true")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        if args.cpu_smoke:
            from sliderl.core.tiny import make_tiny_model
            path, device, dtype = make_tiny_model(Path(tmp) / "tiny", "qwen3"), "cpu", "float32"
        else:
            from engine_gpu import build_model
            path, device, dtype = build_model(Path(tmp) / "qwen3-1.7b-random"), "cuda", "bfloat16"
        for spec_at in args.runs:
            spec, kv_gb, *budget = spec_at.split("@")
            budget_s = float(budget[0]) if budget else args.budget_s
            rows.append(run(path, spec, float(kv_gb), args.seqs, args.tokens, budget_s, device, dtype))
            print(json.dumps(rows[-1]), flush=True)
            if args.reference and not args.cpu_smoke and spec != "full":
                from engine_gpu import bench_engine
                ref = bench_engine(path, spec, args.tokens, args.reference_steps, float(kv_gb), rows[-1]["max_running"])
                rows[-1]["steady_state_tokens_per_s"] = ref["tokens_per_s"]
                rows[-1]["steady_state_batch"] = ref["batch"]
                print(json.dumps({"reference": spec, **{k: ref[k] for k in ("batch", "tokens_per_s")}}), flush=True)
    print(f"\n{'run':<28}{'done':>5}{'s':>7}{'avg tok/s':>10}{'last 1/4':>10}{'steady':>9}{'last/steady':>12}"
          f"{'preempt':>8}{'running':>8}")
    for r in rows:
        steady = r.get("steady_state_tokens_per_s")
        ratio = f"{r['last_quarter_tokens_per_s'] / steady:.3f}" if steady else "-"
        print(f"{r['policy'] + '@' + format(r['kv_cache_gb'], 'g'):<28}{'yes' if r['finished'] else 'no':>5}"
              f"{r['seconds']:>7.0f}{r['tokens_per_s']:>10.0f}{r['last_quarter_tokens_per_s']:>10.0f}"
              f"{steady or 0:>9.0f}{ratio:>12}{r['preemptions']:>8}{r['max_running']:>8}")
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
