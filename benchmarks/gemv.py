"""The decoder's linear layers at small batch: torch's ``F.linear`` (cuBLAS) vs ``kernels.gemv``.

    python benchmarks/gemv.py [--m 1 2 4 8] [--sweep]

Shapes are Qwen3-1.7B's (bf16): fused q/k/v, fused gate/up, o_proj, down_proj and the lm_head. As in
a decode step, each call reads a different weight: one CUDA graph holds a call on each of enough
copies of W to overflow L2 (>= 256 MB), so every read comes from HBM and launch gaps are those of a
graph. Reported per call: microseconds (CUDA events around a replay, median of 50 after warm-up,
divided by the copies), GB/s of W read (x and y are negligible at M <= 8), and cuBLAS time / GEMV
time. ``--sweep`` also times launch shapes around ``gemv_config``'s choice at M = 1 (slower: one
compile per shape tried) and prints the best few per layer and the default's own time, the MLP tail's shapes
too. Two rows time the decoder MLP's tail ``h + down(silu(gate) * up)`` against torch's SiLU, multiply, cuBLAS GEMM
and add: ``silu_down``, as the engine runs it with ``gemv`` (``silu_mul``, then the down GEMV adding the residual),
and ``down_tail``, the GEMV's one-launch ``swiglu`` mode (92 us against torch's 16.6 on the H200 at 1bbeb04, why
the engine no longer uses it).
"""

from __future__ import annotations

import argparse
import itertools
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from triton.runtime.errors import OutOfResources  # noqa: E402

from sliderl.kernels.gemv import GemvConfig, gemv, gemv_config  # noqa: E402

# (N, K) of Qwen3-1.7B: hidden 2048, 16 q + 8 + 8 KV heads of 128, intermediate 6144, vocab 151936
SHAPES = {"qkv": (4096, 2048), "gate_up": (12288, 2048), "o_proj": (2048, 2048), "down_proj": (2048, 6144),
          "lm_head": (151936, 2048)}
L2_OVERFLOW_BYTES = 256 * 2**20


def graph_us(calls, repeats: int = 50) -> float:
    """Median microseconds per call of ``calls`` (zero-argument functions) replayed as one CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: compiles, allocates split counters, outside capture
        for fn in calls:
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in calls:
            fn()
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return 1e3 * statistics.median(times) / len(calls)


def weights(n: int, k: int) -> list[torch.Tensor]:
    """Enough bf16 copies of a ``[N, K]`` weight that one pass over them overflows L2."""
    copies = max(1, math.ceil(L2_OVERFLOW_BYTES / (n * k * 2)))
    return [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]


def compare(name: str, ws: list[torch.Tensor], m: int) -> None:
    n, k = ws[0].shape
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    ref = F.linear(x.double(), ws[0].double())
    for y in (F.linear(x, ws[0]), gemv(x, ws[0])):  # both within bf16 rounding of the float64 product
        assert (y.double() - ref).abs().max() <= 0.02 * ref.abs().max(), name
    torch_us = graph_us([lambda w=w: F.linear(x, w) for w in ws])
    gemv_us = graph_us([lambda w=w: gemv(x, w) for w in ws])
    gb = n * k * 2 / 1e9
    cfg = gemv_config(n, k, torch.bfloat16, x.device)
    print(f"{name:<10}{n:>7}{k:>6}{m:>3}{torch_us:>10.1f}{gb / torch_us * 1e6:>10.0f}{gemv_us:>10.1f}"
          f"{gb / gemv_us * 1e6:>10.0f}{torch_us / gemv_us:>8.2f}x   {cfg.block_n}x{cfg.block_k}/{cfg.num_splits}",
          flush=True)


def compare_tail(ws: list[torch.Tensor], m: int) -> None:
    """The MLP tail: torch's four launches vs the engine's silu_mul + GEMV and the one-launch swiglu GEMV (same
    bytes of W per call)."""
    from sliderl.kernels.norm_rope import silu_mul

    n, k = ws[0].shape
    gate_up = torch.randn(m, 2 * k, device="cuda", dtype=torch.bfloat16)
    h = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)

    def torch_tail(w):
        return h + F.linear(F.silu(gate_up[:, :k]) * gate_up[:, k:], w)

    tails = {"silu_down": (lambda w: gemv(silu_mul(gate_up), w, residual=h), False),
             "down_tail": (lambda w: gemv(gate_up, w, swiglu=True, residual=h), True)}
    g = gate_up.double()[:, :k]
    ref = h.double() + F.linear(g * torch.sigmoid(g) * gate_up.double()[:, k:], ws[0].double())
    for name, y in [("torch", torch_tail(ws[0]))] + [(name, tail(ws[0])) for name, (tail, _) in tails.items()]:
        assert (y.double() - ref).abs().max() <= 0.02 * ref.abs().max(), name
    torch_us = graph_us([lambda w=w: torch_tail(w) for w in ws])
    gb = n * k * 2 / 1e9
    for name, (tail, swiglu) in tails.items():
        gemv_us = graph_us([lambda w=w: tail(w) for w in ws])
        cfg = gemv_config(n, k, torch.bfloat16, gate_up.device, swiglu=swiglu)
        print(f"{name:<10}{n:>7}{k:>6}{m:>3}{torch_us:>10.1f}{gb / torch_us * 1e6:>10.0f}{gemv_us:>10.1f}"
              f"{gb / gemv_us * 1e6:>10.0f}{torch_us / gemv_us:>8.2f}x   {cfg.block_n}x{cfg.block_k}/{cfg.num_splits}",
              flush=True)


def sweep(name: str, ws: list[torch.Tensor], top: int = 4, tail: bool = False) -> None:
    """Time launch shapes around the default at M = 1; print the fastest ``top``. ``tail``: the MLP's fused tail
    (``swiglu``, ``residual``) at down_proj's shape, whose SiLU temporaries bound its tiles (a spilling shape shows
    as a slow one), also over 8 warps."""
    n, k = ws[0].shape
    x = torch.randn(1, 2 * k if tail else k, device="cuda", dtype=torch.bfloat16)
    h = torch.randn(1, n, device="cuda", dtype=torch.bfloat16)
    gb = n * k * 2 / 1e9
    results = []
    shapes = (itertools.product((16, 32), (64, 128, 256), (1, 2, 4), (4, 6), (4, 8)) if tail else
              itertools.product((16, 32, 64, 128), (64, 128, 256, 512), (1, 2, 4, 8), (3, 4), (4,)))
    for block_n, block_k, splits, stages, warps in shapes:
        if block_n * block_k * 2 > 65536 or (splits > 1 and math.ceil(n / block_n) * splits > 8 * 132):
            continue  # tiles over 64 KB, or far more programs than any GPU here has slots for
        cfg = GemvConfig(block_n, block_k, splits, num_warps=warps, num_stages=stages)
        calls = ([lambda w=w: gemv(x, w, config=cfg, swiglu=True, residual=h) for w in ws] if tail else
                 [lambda w=w: gemv(x, w, config=cfg) for w in ws])
        try:
            results.append((graph_us(calls, repeats=20), cfg))
        except OutOfResources:  # more shared memory than the GPU has: skip it, say so
            print(f"  {name} {cfg}: out of resources", flush=True)
    default = gemv_config(n, k, torch.bfloat16, x.device, swiglu=tail)
    ranked = sorted(results, key=lambda r: r[0])
    shown = ranked[:top] + [r for r in ranked[top:] if r[1] == default]  # the default's own row, wherever it ranks
    for us, cfg in shown:
        mark = "  (default)" if cfg == default else ""
        print(f"  {name:<10}{us:>8.1f} us {gb / us * 1e6:>6.0f} GB/s  {cfg}{mark}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--m", type=int, nargs="+", default=[1, 2, 4, 8], help="rows of x (tokens)")
    parser.add_argument("--sweep", action="store_true", help="also sweep launch shapes at M = 1 (minutes)")
    args = parser.parse_args()
    print(f"{'layer':<10}{'N':>7}{'K':>6}{'M':>3}{'cuBLAS us':>10}{'GB/s':>10}{'GEMV us':>10}{'GB/s':>10}"
          f"{'ratio':>9}   config")
    for name, (n, k) in SHAPES.items():
        ws = weights(n, k)
        for m in args.m:
            compare(name, ws, m)
            if name == "down_proj":
                compare_tail(ws, m)
        if args.sweep:
            sweep(name, ws)
            if name == "down_proj":
                sweep("down_tail", ws, tail=True)
        del ws
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
