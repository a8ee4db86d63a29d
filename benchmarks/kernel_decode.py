"""Decode attention on the GPU: the Triton paged kernel against torch SDPA and FlexAttention.

Shape: Qwen3-1.7B attention (16 query heads, 8 KV heads, head dim 128, bf16), prefix_sliding with a
100-token prefix, one query per sequence at position ``pos``. Rows: batch x window x position.

- ``triton``: ``kernels.decode.decode_attention`` (what ``kernels.paged_attention`` runs for decode)
  over a pool holding only live blocks, shuffled; default launch shape (``--sweep`` tries others).
- ``sdpa``: ``F.scaled_dot_product_attention`` on a contiguous cache of exactly the visible keys
  (no mask; the GQA group rides in the query-length dim, so K/V are read once per KV head).
- ``flex``: compiled ``flex_attention`` over a full-length cache with the prefix_sliding mask as a
  block mask (skipped when that cache exceeds half of ``--mem-gb``).

Times are medians of ``triton.testing.do_bench`` over CUDA-graph replays of at least 16 calls that
cycle through enough input sets to exceed 4x the L2 cache. Bandwidth counts the bytes that must move: visible K/V + q + o.
The copy ceiling is a large device-to-device copy (read + write) measured in the same run.

    python benchmarks/kernel_decode.py [--quick] [--check] [--sweep] [--out table.json]

FlexAttention compiles once per row (different mask constants and lengths): the full 27-row table
may not fit one 10-minute call; split it with ``--batch`` / ``--window`` / ``--pos``, or ``--no-flex``.
Rows are appended to ``--out`` as they finish.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sliderl import kernels  # noqa: E402
import sliderl.kernels.reference as reference  # noqa: E402
from sliderl.kernels.decode import DecodeConfig, decode_attention, decode_config  # noqa: E402
from sliderl.kernels.metadata import AttentionMetadata, PagedKVCache  # noqa: E402

NEVER = 2**31 - 1
GB = 1e9
DEVICE = torch.device("cuda")
DTYPE = torch.bfloat16


@dataclass(frozen=True)
class Shape:
    batch: int
    window: int
    pos: int  # position of each sequence's query token
    prefix: int = 100
    block_size: int = 16
    q_heads: int = 16
    kv_heads: int = 8
    head_dim: int = 128

    def visible(self) -> torch.Tensor:
        """Positions the query sees: the prefix plus the last ``window`` positions (itself included)."""
        k = torch.arange(self.pos + 1)
        return k[(k < self.prefix) | (self.pos - k < self.window)]

    def live_blocks(self) -> torch.Tensor:
        """Logical indices of the blocks holding a visible position, ascending."""
        return torch.unique(self.visible() // self.block_size)

    def must_read_bytes(self, elem: int = 2) -> int:
        kv = 2 * self.batch * self.visible().numel() * self.kv_heads * self.head_dim * elem
        return kv + 2 * self.batch * self.q_heads * self.head_dim * elem  # + q + o

    def full_cache_bytes(self, elem: int = 2) -> int:
        return 2 * self.batch * self.full_len() * self.kv_heads * self.head_dim * elem

    def full_len(self) -> int:
        return 128 * math.ceil((self.pos + 1) / 128)


@dataclass
class PagedSet:
    """One input set: a pool slice with its metadata, q and output buffers, plus the K/V gather map."""

    meta: AttentionMetadata
    q: torch.Tensor  # [B, H_q, D]
    out: torch.Tensor
    slots: torch.Tensor  # [B, L] flat pool slots of the visible positions, in position order


# ---------------------------------------------------------------------------------------------
# Building inputs


def build_paged(shape: Shape, sets: int, dtype: torch.dtype, device: str) -> tuple[PagedKVCache, list[PagedSet]]:
    """A pool of ``sets * batch * live`` shuffled blocks and ``sets`` metadata sets over disjoint parts."""
    live = shape.live_blocks().to(device)  # [M] logical block indices
    m, bs = live.numel(), shape.block_size
    num_blocks = sets * shape.batch * m
    cache = PagedKVCache.allocate(1, num_blocks, bs, shape.kv_heads, shape.head_dim, dtype, device)
    cache.k[0].normal_()
    cache.v[0].normal_()
    physical = torch.randperm(num_blocks, device=device).view(sets, shape.batch, m).int()
    positions = live[:, None] * bs + torch.arange(bs, device=device)  # [M, bs]
    death = torch.where(positions < shape.prefix, NEVER, positions + shape.window).int()
    cache.death[physical.view(-1, m).long()] = death  # every sequence lays out the same positions
    visible = shape.visible().to(device)
    live_slot = torch.searchsorted(live, visible // bs)  # [L] index into the live list
    result = []
    for s in range(sets):
        tables = physical[s]  # [B, M]
        meta = AttentionMetadata(
            query_start=torch.arange(shape.batch + 1, dtype=torch.int32, device=device),
            query_pos=torch.full((shape.batch,), shape.pos, dtype=torch.int32, device=device),
            slot_mapping=torch.zeros(shape.batch, dtype=torch.int64, device=device),
            slot_death=torch.zeros(shape.batch, dtype=torch.int32, device=device),
            block_tables=tables.contiguous(),
            block_index=live.int().expand(shape.batch, m).contiguous(),
            num_live_blocks=torch.full((shape.batch,), m, dtype=torch.int32, device=device),
            max_query_len=1, max_live_blocks=m)
        q = torch.randn(shape.batch, shape.q_heads, shape.head_dim, dtype=dtype, device=device)
        slots = tables[:, live_slot].long() * bs + (visible % bs)  # [B, L]
        result.append(PagedSet(meta, q, torch.empty_like(q), slots))
    return cache, result


def contiguous_kv(cache: PagedKVCache, ps: PagedSet) -> tuple[torch.Tensor, torch.Tensor]:
    """The visible keys/values of every sequence as ``[B, H_kv, L, D]`` contiguous tensors."""
    flat_k = cache.k[0].view(-1, *cache.k[0].shape[2:])
    flat_v = cache.v[0].view(-1, *cache.v[0].shape[2:])
    return flat_k[ps.slots].transpose(1, 2).contiguous(), flat_v[ps.slots].transpose(1, 2).contiguous()


def count_sets(bytes_per_set: int, budget: float, l2: int, most: int = 32) -> int:
    """Input sets to cycle through: enough to pass 4x L2, within the memory budget."""
    want = max(2, math.ceil(4 * l2 / max(1, bytes_per_set)))
    return max(1, min(want, most, int(budget // max(1, bytes_per_set))))


# ---------------------------------------------------------------------------------------------
# Timing


def time_calls(calls: list, min_calls: int = 16) -> tuple[float, bool]:
    """Median ms per call: a CUDA graph replaying the calls (cycled to at least ``min_calls``), timed
    by do_bench; eager if capture fails. Many calls per graph keep the graph launch itself (several
    us) out of the per-call time, as in the engine, where 28 layers' calls share one graph.
    """
    import triton.testing

    calls = [calls[i % len(calls)] for i in range(max(len(calls), min_calls))]

    for fn in calls:
        fn()
    torch.cuda.synchronize()
    try:
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for fn in calls:  # warm-up on the capture stream
                fn()
            with torch.cuda.graph(graph, stream=stream):
                for fn in calls:
                    fn()
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        ms = triton.testing.do_bench(graph.replay, warmup=50, rep=300, return_mode="median")
        return ms / len(calls), True
    except RuntimeError as err:
        print(f"    (graph capture failed: {str(err).splitlines()[0][:120]}; timing eagerly)", flush=True)

        def run_all():
            for fn in calls:
                fn()

        ms = triton.testing.do_bench(run_all, warmup=50, rep=300, return_mode="median")
        return ms / len(calls), False


def copy_bandwidth(gbytes: float = 2.0) -> float:
    """Bytes/s of a device-to-device copy of ``gbytes`` GB (counting read + write)."""
    import triton.testing

    n = int(gbytes * GB) // 2
    src = torch.randn(n, dtype=DTYPE, device=DEVICE)
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    return 2 * n * 2 / (ms * 1e-3)


# ---------------------------------------------------------------------------------------------
# The three implementations on one row


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm())


def bench_triton(shape, cache, sets, scale, config=None):
    calls = [lambda ps=ps: decode_attention(ps.q, cache, 0, ps.meta, scale, config=config, out=ps.out) for ps in sets]
    return time_calls(calls)


def sdpa_inputs(shape, cache, sets):
    """Per set: q as ``[B, H_kv, G, D]`` (the group in the length dim) and contiguous visible K/V."""
    g = shape.q_heads // shape.kv_heads
    return [(ps.q.view(shape.batch, shape.kv_heads, g, shape.head_dim), *contiguous_kv(cache, ps)) for ps in sets]


def run_sdpa(q, k, v, scale):
    return F.scaled_dot_product_attention(q, k, v, scale=scale)  # [B, H_kv, G, D]


def flex_inputs(shape, cache, sets, sdpa_sets):
    """Per set: q ``[B, H_q, 1, D]``, a full-length cache holding the visible K/V at their positions, a block mask."""
    from torch.nn.attention.flex_attention import create_block_mask

    length, prefix, window, pos = shape.full_len(), shape.prefix, shape.window, shape.pos
    device = cache.k[0].device
    visible = shape.visible().to(device)

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= pos) & ((kv_idx < prefix) | (pos - kv_idx < window))

    mask = create_block_mask(mask_mod, None, None, 1, length, device=device)
    result = []
    for ps, (_, kc, vc) in zip(sets, sdpa_sets):
        full = (shape.batch, shape.kv_heads, length, shape.head_dim)
        kf = torch.randn(full, dtype=kc.dtype, device=device)
        vf = torch.randn(full, dtype=vc.dtype, device=device)
        kf[:, :, visible], vf[:, :, visible] = kc, vc
        result.append((ps.q.unsqueeze(2), kf, vf, mask))
    return result


_FLEX = None


def run_flex(q, k, v, mask, scale):
    global _FLEX
    if _FLEX is None:
        from torch.nn.attention.flex_attention import flex_attention
        for name in ("cache_size_limit", "recompile_limit"):  # one compile per row: don't fall back to eager
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, 256)
        _FLEX = torch.compile(flex_attention, dynamic=False)
    return _FLEX(q, k, v, block_mask=mask, scale=scale, enable_gqa=True)  # [B, H_q, 1, D]


def bench_row(shape: Shape, args, copy_bw: float, l2: int) -> dict:
    scale = shape.head_dim ** -0.5
    elem = 2
    pool_bytes = 2 * shape.batch * shape.live_blocks().numel() * shape.block_size * shape.kv_heads * shape.head_dim * elem
    n_sets = count_sets(pool_bytes, args.mem_gb * GB / 3, l2)  # pool + contiguous copy + headroom
    cache, sets = build_paged(shape, n_sets, DTYPE, DEVICE)
    must = shape.must_read_bytes()
    cfg = decode_config(shape.batch, shape.kv_heads, shape.block_size, sets[0].meta.max_live_blocks,
                        shape.head_dim, DTYPE, DEVICE)
    row = {**asdict(shape), "visible_keys": shape.visible().numel(), "sets": n_sets, "must_read_MB": must / 1e6,
           "config": asdict(cfg)}
    sdpa_sets = sdpa_inputs(shape, cache, sets) if not args.no_sdpa or not args.no_flex else None
    if args.check:
        row.update(check_row(shape, cache, sets[0], sdpa_sets[0] if sdpa_sets else None, scale))
    ms, graphed = bench_triton(shape, cache, sets, scale)
    row.update(triton_us=ms * 1e3, triton_graph=graphed, triton_bw=must / (ms * 1e-3) / copy_bw)
    if not args.no_sdpa:
        ms, graphed = time_calls([lambda s=s: run_sdpa(*s, scale) for s in sdpa_sets])
        row.update(sdpa_us=ms * 1e3, sdpa_bw=must / (ms * 1e-3) / copy_bw)
    if not args.no_flex:
        row.update(bench_flex(shape, cache, sets, sdpa_sets, scale, args, must, copy_bw))
    del cache, sets, sdpa_sets
    torch.cuda.empty_cache()
    return row


def bench_flex(shape, cache, sets, sdpa_sets, scale, args, must, copy_bw) -> dict:
    full = shape.full_cache_bytes()
    if full > args.mem_gb * GB / 2:
        return {"flex_skipped": f"full cache {full / GB:.1f} GB > {args.mem_gb / 2:.0f} GB budget"}
    n = max(1, min(len(sets), int(args.mem_gb * GB / 2 // full)))
    try:
        flex_sets = flex_inputs(shape, cache, sets[:n], sdpa_sets[:n])
        ms, graphed = time_calls([lambda s=s: run_flex(*s, scale) for s in flex_sets])
        result = {"flex_us": ms * 1e3, "flex_graph": graphed, "flex_bw": must / (ms * 1e-3) / copy_bw}
        if args.check:
            mine = decode_attention(sets[0].q, cache, 0, sets[0].meta, scale)
            result["flex_vs_triton"] = rel_err(run_flex(*flex_sets[0], scale).squeeze(2), mine)
        return result
    except (RuntimeError, torch.OutOfMemoryError) as err:  # a compile or capture failure is reported, not fatal
        return {"flex_skipped": f"error: {str(err).splitlines()[0][:160]}"}


def check_row(shape, cache, ps: PagedSet, sdpa_set, scale) -> dict:
    """Triton vs the torch reference (fp32 softmax) on the same pool; SDPA vs Triton on the same K/V."""
    mine = kernels.paged_attention(ps.q, cache, 0, ps.meta, scale)
    ref = reference.paged_attention(ps.q, cache, 0, ps.meta, scale, acc_dtype=torch.float32)
    result = {"triton_vs_reference": rel_err(mine, ref), "nan": bool(torch.isnan(mine).any())}
    if sdpa_set is not None:
        sd = run_sdpa(*sdpa_set, scale).reshape(shape.batch, shape.q_heads, shape.head_dim)
        result["sdpa_vs_triton"] = rel_err(sd, mine)
    ok = result["triton_vs_reference"] <= 1e-2 and not result["nan"]
    print(f"    check: triton vs reference {result['triton_vs_reference']:.2e}"
          + (f", sdpa vs triton {result['sdpa_vs_triton']:.2e}" if "sdpa_vs_triton" in result else "")
          + ("  OK" if ok else "  FAIL"), flush=True)
    result["check_ok"] = ok
    return result


# ---------------------------------------------------------------------------------------------
# Sweep of launch shapes on a few rows


def sweep(shapes: list[Shape], args, copy_bw: float, l2: int) -> list[dict]:
    """Time tile/warps/stages at the default splits, then splits around the best; print the best per row."""
    rows = []
    for shape in shapes:
        scale = shape.head_dim ** -0.5
        pool_bytes = 2 * shape.batch * shape.live_blocks().numel() * shape.block_size * shape.kv_heads * shape.head_dim * 2
        cache, sets = build_paged(shape, count_sets(pool_bytes, args.mem_gb * GB / 2, l2), DTYPE, DEVICE)
        must = shape.must_read_bytes()
        base = decode_config(shape.batch, shape.kv_heads, shape.block_size, sets[0].meta.max_live_blocks,
                             shape.head_dim, DTYPE, DEVICE)
        # K/V get num_stages - 1 shared-memory buffers (see decode_config)
        splits = args.sweep_splits or [base.num_splits]
        configs = [DecodeConfig(t, n, w, s) for n in splits for t in (32, 64, 128) for w in (4, 8) for s in (2, 3, 4, 5)]
        results = [_sweep_one(shape, cache, sets, scale, c, must, copy_bw) for c in configs]
        best = min((r for r in results if "us" in r), key=lambda r: r["us"])
        b = DecodeConfig(**best["config"])
        for n in sorted({1, 2, 3, 4, 6, 8, 12, 16, 24, 32} - {b.num_splits}):
            results.append(_sweep_one(shape, cache, sets, scale, DecodeConfig(b.tile_n, n, b.num_warps, b.num_stages),
                                      must, copy_bw))
        best = min((r for r in results if "us" in r), key=lambda r: r["us"])
        print(f"  best for batch {shape.batch} W {shape.window} pos {shape.pos}: {best['config']} "
              f"{best['us']:.1f} us, {100 * best['bw']:.0f}% of copy (default {asdict(base)})", flush=True)
        rows.append({"shape": asdict(shape), "default": asdict(base), "results": results})
        del cache, sets
        torch.cuda.empty_cache()
    return rows


def _sweep_one(shape, cache, sets, scale, cfg, must, copy_bw) -> dict:
    try:
        ms, _ = bench_triton(shape, cache, sets, scale, config=cfg)
    except Exception as err:  # noqa: BLE001  an out-of-resources config is a result of the sweep
        print(f"    {asdict(cfg)}: {type(err).__name__}", flush=True)
        return {"config": asdict(cfg), "error": f"{type(err).__name__}: {str(err)[:120]}"}
    print(f"    {asdict(cfg)}: {ms * 1e3:8.1f} us  {100 * must / (ms * 1e-3) / copy_bw:5.1f}% of copy", flush=True)
    return {"config": asdict(cfg), "us": ms * 1e3, "bw": must / (ms * 1e-3) / copy_bw}


# ---------------------------------------------------------------------------------------------
# Output


def print_table(rows: list[dict], copy_bw: float) -> None:
    print(f"\ncopy bandwidth {copy_bw / 1e12:.2f} TB/s (read+write); bw% = must-read bytes / time / copy bandwidth")
    head = f"{'batch':>5} {'W':>5} {'pos':>7} {'keys':>5} {'MB':>7} | {'triton us':>9} {'bw%':>4} {'splits':>6} | " \
           f"{'sdpa us':>8} {'bw%':>4} | {'flex us':>8} {'bw%':>4} | {'vs ref':>8}"
    print(head)
    print("-" * len(head))
    for r in rows:
        sd = f"{r['sdpa_us']:8.1f} {100 * r['sdpa_bw']:4.0f}" if "sdpa_us" in r else f"{'-':>8} {'-':>4}"
        fx = f"{r['flex_us']:8.1f} {100 * r['flex_bw']:4.0f}" if "flex_us" in r else f"{'skip':>8} {'-':>4}"
        ck = f"{r['triton_vs_reference']:8.1e}" if "triton_vs_reference" in r else f"{'-':>8}"
        print(f"{r['batch']:5d} {r['window']:5d} {r['pos']:7d} {r['visible_keys']:5d} {r['must_read_MB']:7.1f} | "
              f"{r['triton_us']:9.1f} {100 * r['triton_bw']:4.0f} {r['config']['num_splits']:6d} | {sd} | {fx} | {ck}")
    skipped = [r for r in rows if "flex_skipped" in r]
    for r in skipped:
        print(f"flex skipped at batch {r['batch']} W {r['window']} pos {r['pos']}: {r['flex_skipped']}")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="batch 1/16/256 at W=4096, pos=32768 only")
    p.add_argument("--check", action="store_true", help="verify each row against kernels.reference first")
    p.add_argument("--sweep", action="store_true", help="sweep launch shapes (tile, warps, stages, splits) instead")
    p.add_argument("--sweep-splits", type=int, nargs="+", help="with --sweep: try every tile/warps/stages at each of "
                   "these split counts (default: the default split count only)")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16, 256])
    p.add_argument("--window", type=int, nargs="+", help="default 2048 4096 8192 (4096 with --quick/--sweep)")
    p.add_argument("--pos", type=int, nargs="+", help="default 8192 32768 131072 (32768 with --quick/--sweep)")
    p.add_argument("--mem-gb", type=float, default=24.0, help="memory budget for inputs (GB)")
    p.add_argument("--no-sdpa", action="store_true")
    p.add_argument("--no-flex", action="store_true")
    p.add_argument("--out", type=Path, help="write the rows as JSON here")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    if not torch.cuda.is_available():
        sys.exit("kernel_decode.py needs a CUDA GPU")
    short = args.quick or args.sweep
    args.window = args.window or ([4096] if short else [2048, 4096, 8192])
    args.pos = args.pos or ([32768] if short else [8192, 32768, 131072])
    props = torch.cuda.get_device_properties(0)
    l2 = getattr(props, "L2_cache_size", 60 * 2**20)
    import triton
    print(f"{props.name}: {props.multi_processor_count} SMs, L2 {l2 / 2**20:.0f} MiB; torch {torch.__version__}, "
          f"triton {triton.__version__}", flush=True)
    copy_bw = copy_bandwidth()
    print(f"copy bandwidth {copy_bw / 1e12:.2f} TB/s", flush=True)
    shapes = [Shape(b, w, p) for b in args.batch for w in args.window for p in args.pos]
    torch.manual_seed(0)
    if args.sweep:
        report = {"copy_bw": copy_bw, "sweep": sweep(shapes, args, copy_bw, l2)}
    else:
        rows = []
        for shape in shapes:
            t0 = time.time()
            print(f"  batch {shape.batch} W {shape.window} pos {shape.pos} ...", flush=True)
            rows.append(bench_row(shape, args, copy_bw, l2))
            r = rows[-1]
            print(f"    triton {r['triton_us']:.1f} us ({100 * r['triton_bw']:.0f}% of copy)"
                  + (f", sdpa {r['sdpa_us']:.1f} us" if "sdpa_us" in r else "")
                  + (f", flex {r['flex_us']:.1f} us" if "flex_us" in r else f", flex: {r.get('flex_skipped', 'off')}")
                  + f"  [{time.time() - t0:.0f} s]", flush=True)
            if args.out:
                args.out.write_text(json.dumps({"copy_bw": copy_bw, "rows": rows}, indent=1))
        print_table(rows, copy_bw)
        report = {"copy_bw": copy_bw, "rows": rows}
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
