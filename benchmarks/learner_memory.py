"""Peak memory of one learner step as the trace grows: truncated windows vs whole-trace backprop.

Each (window_mode, T) runs in a fresh subprocess that builds a Learner on a small random Qwen3,
makes one GRPO group of two synthetic ``prefix_sliding:W`` traces of T generated tokens (rewards
0 and 1, so both train; one window per micro-batch) and takes one step. On CPU it reports the
process's peak RSS (``resource.getrusage(RUSAGE_SELF).ru_maxrss``) before and after the step; on
CUDA, ``torch.cuda.max_memory_allocated``. Expected: ``truncated`` stays flat once T > k·W (the
model sees P + k·W tokens whatever T is); ``full`` grows with T.

    python benchmarks/learner_memory.py --lengths 1024 2048 4096 8192 --window 256
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def child(args: argparse.Namespace) -> dict:
    """One measurement in this (fresh) process."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    sys.path.insert(0, str(ROOT))
    import torch

    from sliderl.core.trace import Trace
    from sliderl.trainer.learner import Learner

    learner = Learner(args.model, window_mode=args.mode, multiplier=args.multiplier, micro_batch_tokens=1,
                      device=args.device, lr=1e-5)
    gen = torch.Generator().manual_seed(0)
    traces = [Trace(f"t{i}", "g", "p", 0, 0, f"prefix_sliding:{args.window}",
                    torch.randint(0, 256, (args.prompt,), generator=gen).tolist(),
                    torch.randint(0, 256, (args.length,), generator=gen).tolist(),
                    [-5.0] * args.length, "length", reward=float(i)) for i in (0, 1)]
    cuda = args.device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    before = _peak_mib(cuda)
    start = time.perf_counter()
    metrics = learner.step([traces])
    seconds = time.perf_counter() - start
    return {"mode": args.mode, "T": args.length, "inputs_per_window": metrics.num_tokens / 2,
            "peak_before_mib": before, "peak_mib": _peak_mib(cuda), "seconds": seconds}


def _peak_mib(cuda: bool) -> float:
    if cuda:
        import torch

        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def run_one(args: argparse.Namespace, mode: str, length: int) -> dict:
    cmd = [sys.executable, __file__, "--child", "--model", args.model, "--mode", mode, "--length", str(length),
           "--window", str(args.window), "--multiplier", str(args.multiplier), "--prompt", str(args.prompt),
           "--device", args.device]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    return json.loads(out.stdout.strip().splitlines()[-1])


def build_model(args: argparse.Namespace, root: Path) -> str:
    sys.path.insert(0, str(ROOT))
    from sliderl.core.tiny import make_tiny_model

    return str(make_tiny_model(root / "model", "qwen3", hidden_size=args.hidden_size, num_layers=args.layers,
                               num_heads=8, num_kv_heads=4, intermediate_size=4 * args.hidden_size,
                               max_position_embeddings=65536))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    parser.add_argument("--modes", nargs="+", default=["truncated", "full"])
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--multiplier", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    parser.add_argument("--length", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        args.model = build_model(args, Path(tmp))
        unit = "peak CUDA MiB" if args.device.startswith("cuda") else "peak RSS MiB"
        print(f"qwen3 hidden={args.hidden_size} layers={args.layers}, P={args.prompt}, "
              f"prefix_sliding:{args.window}, k={args.multiplier}, GRPO group of 2, one window per micro-batch, "
              f"device={args.device}")
        print(f"{'mode':<10} {'T':>7} {'inputs/window':>14} {unit + ' before':>22} {unit + ' after':>21} "
              f"{'step MiB':>9} {'step s':>7}")
        for mode in args.modes:
            for length in args.lengths:
                r = run_one(args, mode, length)
                print(f"{r['mode']:<10} {r['T']:>7} {int(r['inputs_per_window']):>14} {r['peak_before_mib']:>22.0f} "
                      f"{r['peak_mib']:>21.0f} {r['peak_mib'] - r['peak_before_mib']:>9.0f} {r['seconds']:>7.2f}",
                      flush=True)


if __name__ == "__main__":
    main()
