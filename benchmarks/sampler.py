"""The sampler per decode step: the torch path vs the fused Triton kernel, at a Qwen3 vocabulary.

    python benchmarks/sampler.py [--batch 1 64 256] [--vocab 151936]

Rows sample at temperature 1 (Gumbel-max, the RL rollout case) and at 0 (greedy); both paths
return the same tokens (checked here too). ``sample`` takes the fused kernel only when some row
samples (all-greedy batches stay on argmax + logsumexp, faster there). Reported: milliseconds per call (CUDA events, median
of 50 after 5 warm-ups) and the ratio.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from sliderl.rollout.sampling import sample, torch_sample  # noqa: E402


def time_ms(fn, repeats: int = 50) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--vocab", type=int, default=151936)
    args = parser.parse_args()
    print(f"{'batch':>6}{'T':>5}{'torch ms':>10}{'fused ms':>10}{'ratio':>8}")
    for b in args.batch:
        logits = torch.randn(b, args.vocab, device="cuda") * 3
        seed = torch.arange(b, device="cuda", dtype=torch.long)
        step = torch.full((b,), 4096, device="cuda", dtype=torch.long)
        for t in (1.0, 0.0):
            rows = (torch.full((b,), t, device="cuda"), torch.ones(b, device="cuda"),
                    torch.full((b,), -1, device="cuda", dtype=torch.long), seed, step)
            kw = dict(all_greedy=t == 0, any_truncation=False)
            assert torch.equal(sample(logits, *rows, **kw)[0], torch_sample(logits, *rows, **kw)[0])
            from sliderl.kernels.sample import fused_sample
            slow = time_ms(lambda: torch_sample(logits, *rows, **kw))
            fast = time_ms(lambda: fused_sample(logits, rows[0], seed, step))
            print(f"{b:>6}{t:>5g}{slow:>10.3f}{fast:>10.3f}{slow / fast:>7.1f}x", flush=True)


if __name__ == "__main__":
    main()
