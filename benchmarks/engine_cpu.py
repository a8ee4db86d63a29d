"""Engine throughput and KV use per KV policy against generated length, on a tiny CPU model.

    python benchmarks/engine_cpu.py [--lengths 256 1024 2048] [--window 128] [--batch 4]

For each policy and length: greedy decode of ``batch`` requests (ignore_eos) from a 16-token prompt;
prints generated tokens/s (wall), peak and mean visible KV tokens and peak blocks per sequence, and
the throughput ratio to ``full`` at the same length (measured in the same run).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from sliderl.core.tiny import make_tiny_model  # noqa: E402
from sliderl.rollout import LLM, SamplingParams  # noqa: E402


def run(path: Path, spec: str, length: int, batch: int) -> dict:
    llm = LLM(str(path), kv=spec, block_size=16, num_blocks=batch * (length // 16 + 4) + 16,
              max_num_seqs=batch, max_num_batched_tokens=2048)
    prompts = [[(7 * i + j) % 250 for j in range(16)] for i in range(batch)]
    params = SamplingParams(max_tokens=length, temperature=0.0, ignore_eos=True)
    llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - t0
    return {
        "policy": spec, "length": length, "batch": batch, "seconds": seconds,
        "tokens_per_s": sum(len(o.token_ids) for o in outs) / seconds,
        "peak_visible": max(o.kv.peak_visible_tokens for o in outs),
        "mean_visible": sum(o.kv.mean_visible_tokens for o in outs) / batch,
        "peak_blocks": max(o.kv.peak_blocks for o in outs),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 2048])
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--out", type=Path, default=None, help="also write the rows as JSON here")
    args = parser.parse_args()
    w = args.window
    policies = ["full", f"prefix_sliding:{w}", f"sliding_window:{w}", f"streaming:4:{w}", "registers:8"]
    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_model(Path(tmp) / "m", "qwen3", hidden_size=128, num_layers=4, num_heads=4,
                               num_kv_heads=2, intermediate_size=256, max_position_embeddings=1 << 16)
        rows = [run(path, spec, n, args.batch) for n in args.lengths for spec in policies]
    full = {r["length"]: r["tokens_per_s"] for r in rows if r["policy"] == "full"}
    print(f"{'policy':<20}{'length':>8}{'tok/s':>10}{'vs full':>9}{'peak vis':>10}{'mean vis':>10}{'peak blk':>10}")
    for r in rows:
        r["vs_full"] = r["tokens_per_s"] / full[r["length"]]
        print(f"{r['policy']:<20}{r['length']:>8}{r['tokens_per_s']:>10.1f}{r['vs_full']:>8.2f}x"
              f"{r['peak_visible']:>10}{r['mean_visible']:>10.1f}{r['peak_blocks']:>10}")
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
