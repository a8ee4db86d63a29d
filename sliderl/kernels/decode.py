"""Decode attention: one query token per sequence over its live blocks, split-K (flash-decoding).

Program (sequence s, KV head h, split j) holds the whole GQA group of h (``[GROUP_PAD, D]``, padded
to 16 rows for ``tl.dot``) so each K/V tile is read once, walks split j's share of s's live-key
tiles with an online softmax in fp32 (base 2), and either writes the normalised output (one
split) or its partial (max, sum, unnormalised acc); the last split of a (sequence, head) to finish
merges the partials into the output in the same launch.

Page mass (Paged H2O, ``mass`` given): the kernel is compiled with ``OUTPUT_MASS`` and, in the same pass
over the keys, stores for every segment of ``SEG`` keys (a power of two dividing both the tile and the
block, so a segment lies in one block-table column) and every query head the log2 of its probability
sum under the running max of its tile, ``m + log2(sum p)``; it also stores each head's final softmax
normaliser (max and sum, after the merge of every split's partial when split-K is on). A small second
kernel (``_page_mass_kernel``) then reads those per-segment values — one float per head per segment,
1/64 of the keys' bytes at head dim 128 and 16-key blocks — rescales them by the final normaliser
(``exp2(lse - max) / sum``), sums over the GQA group and atomically adds them to the segment's column.
The keys are read once, as for every other policy; without ``mass`` the flag is off and the decode
kernel is the code every other policy runs.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from sliderl.kernels.key_tile import EMPTY_MAX, LOG2E, key_tile_slots, live_key_tile
from sliderl.kernels.launch_checks import check_attention, interpreting, next_pow2, output_buffer
from sliderl.kernels.metadata import AttentionMetadata, PagedKVCache
from sliderl.kernels.pdl import check_pdl, launch_options, line_elems, prefetch_l2, wait_then_release


@triton.jit
def _decode_kernel(q_ptr, k_ptr, v_ptr, death_ptr, block_tables_ptr, block_index_ptr, num_live_ptr,
                   query_start_ptr, query_pos_ptr, kill_ptr, out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr,
                   counter_ptr,
                   norm_max_ptr, norm_sum_ptr, seg_lse_ptr,
                   stride_qn, stride_qh, stride_kb, stride_ks, stride_kh,
                   stride_bt, stride_bi, stride_on, stride_oh, num_q_heads, num_kv_heads, scale_log2, max_segs,
                   GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
                   BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
                   PRECISION: tl.constexpr, UPCAST: tl.constexpr, OUTPUT_MASS: tl.constexpr, SEG: tl.constexpr,
                   SEGS_PER_TILE: tl.constexpr, PDL: tl.constexpr, LINE: tl.constexpr, LINES_PAD: tl.constexpr,
                   KILL: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    # the step's metadata is written before the step's first kernel: safe to read before the PDL wait
    row = tl.load(query_start_ptr + seq)
    num_q = tl.minimum(tl.load(query_start_ptr + seq + 1) - row, 1)  # 0 or 1
    q_pos = tl.load(query_pos_ptr + row, mask=num_q > 0, other=-1)
    num_live = tl.load(num_live_ptr + seq) * num_q
    if KILL:  # a pending register kill (metadata.register_kills): positions [kill_lo, kill_hi) are dead already
        kill_lo = tl.load(kill_ptr + 2 * seq)
        kill_hi = tl.load(kill_ptr + 2 * seq + 1)
    num_tiles = tl.cdiv(num_live * BLOCK_SIZE, TILE_N)
    per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    first = split * per_split
    last = tl.minimum(first + per_split, num_tiles)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    bi_row = block_index_ptr + seq.to(tl.int64) * stride_bi
    if PDL:  # ask L2 for this split's K/V lines while the cache write before us finishes (kernels.pdl)
        lines = tl.arange(0, LINES_PAD) * LINE
        line_ok = lines < HEAD_DIM
        for tile in range(first, last):  # the block table only: deaths are the cache write's to finish
            offset, _, _, in_range = key_tile_slots(bt_row, num_live, tile, stride_kb, stride_ks, BLOCK_SIZE, TILE_N)
            head_lines = offset[:, None] + kv_head * stride_kh + lines[None, :]
            line = tl.where(in_range[:, None] & line_ok[None, :], head_lines, 0)
            prefetch_l2(k_ptr + line)
            prefetch_l2(v_ptr + line)
    wait_then_release(PDL)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, DIM_PAD)
    head = kv_head * GROUP + g
    row_ok = g < GROUP * num_q  # [GROUP_PAD]; a scalar-bool '&' would break the interpreter's mask dtype
    d_ok = d < HEAD_DIM
    row64 = row.to(tl.int64)
    q_mask = row_ok[:, None] & d_ok[None, :]
    q = tl.load(q_ptr + row64 * stride_qn + head[:, None] * stride_qh + d[None, :], mask=q_mask, other=0.0)
    if UPCAST:  # the interpreter multiplies bf16 as integers: run its dots in fp32
        q = q.to(tl.float32)

    m_i = tl.full([GROUP_PAD], EMPTY_MAX, tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
    # The next tile's slots are fetched one iteration early so that K/V addresses are loop-carried:
    # Triton's pipeliner then keeps num_stages - 1 K/V tiles in flight (an in-loop table -> K/V load
    # chain would get only (num_stages - 1) // 2).
    offset, pos, death, in_range = live_key_tile(bt_row, bi_row, death_ptr, num_live, first,
                                                 stride_kb, stride_ks, BLOCK_SIZE, TILE_N)
    for tile in range(first, last):
        next_tile = live_key_tile(bt_row, bi_row, death_ptr, num_live, tile + 1,
                                  stride_kb, stride_ks, BLOCK_SIZE, TILE_N)
        visible = in_range & (pos <= q_pos) & (q_pos < death)  # [TILE_N]
        if KILL:
            visible = visible & ((pos < kill_lo) | (pos >= kill_hi))
        k = tl.load(k_ptr + offset[:, None] + kv_head * stride_kh + d[None, :],
                    mask=in_range[:, None] & d_ok[None, :], other=0.0)
        # a dead slot may hold anything, even NaN: never let it into p @ v
        v = tl.load(v_ptr + offset[:, None] + kv_head * stride_kh + d[None, :],
                    mask=visible[:, None] & d_ok[None, :], other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # [GROUP_PAD, TILE_N]
        s = tl.where(visible[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=PRECISION)
        m_i = m_new
        if OUTPUT_MASS:  # each segment's probability sum, as a log2 under this tile's max (-inf: none visible)
            seg_sum = tl.sum(tl.reshape(p, [GROUP_PAD, SEGS_PER_TILE, SEG]), 2)  # [GROUP_PAD, SEGS_PER_TILE]
            seg = tile * SEGS_PER_TILE + tl.arange(0, SEGS_PER_TILE)
            seg_ptrs = seg_lse_ptr + (row64 * num_q_heads + head)[:, None] * max_segs + seg[None, :]
            tl.store(seg_ptrs, m_new[:, None] + tl.log2(seg_sum),
                     mask=row_ok[:, None] & (seg * SEG < num_live * BLOCK_SIZE)[None, :])
        offset, pos, death, in_range = next_tile

    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        out_ptrs = out_ptr + row64 * stride_on + head[:, None] * stride_oh + d[None, :]
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=q_mask)
        if OUTPUT_MASS:  # the global normaliser of each head, for _page_mass_kernel
            tl.store(norm_max_ptr + row64 * num_q_heads + head, m_i, mask=row_ok)
            tl.store(norm_sum_ptr + row64 * num_q_heads + head, l_i, mask=row_ok)
    else:
        # Publish this split's partial; the last split of (seq, kv_head) to arrive merges them all
        # (no second launch). The barrier orders every thread's stores before the release atomic.
        part = (row64 * num_q_heads + head) * NUM_SPLITS  # [GROUP_PAD], split 0 of each head
        tl.store(part_acc_ptr + (part + split)[:, None] * DIM_PAD + d[None, :], acc, mask=row_ok[:, None])
        tl.store(part_max_ptr + part + split, m_i, mask=row_ok)
        tl.store(part_sum_ptr + part + split, l_i, mask=row_ok)
        tl.debug_barrier()
        counter = counter_ptr + seq * num_kv_heads + kv_head
        if tl.atomic_add(counter, 1, sem="acq_rel") == NUM_SPLITS - 1:
            m_i = tl.full([GROUP_PAD], EMPTY_MAX, tl.float32)
            l_i = tl.zeros([GROUP_PAD], tl.float32)
            acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
            for j in tl.static_range(NUM_SPLITS):  # unrolled: all loads in flight at once; .cg: read from L2
                m_j = tl.load(part_max_ptr + part + j, mask=row_ok, other=EMPTY_MAX, cache_modifier=".cg")
                l_j = tl.load(part_sum_ptr + part + j, mask=row_ok, other=0.0, cache_modifier=".cg")
                a_j = tl.load(part_acc_ptr + (part + j)[:, None] * DIM_PAD + d[None, :], mask=row_ok[:, None],
                              other=0.0, cache_modifier=".cg")
                m_new = tl.maximum(m_i, m_j)
                alpha = tl.exp2(m_i - m_new)
                beta = tl.exp2(m_j - m_new)
                l_i = l_i * alpha + l_j * beta
                acc = acc * alpha[:, None] + a_j * beta[:, None]
                m_i = m_new
            out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            out_ptrs = out_ptr + row64 * stride_on + head[:, None] * stride_oh + d[None, :]
            tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=q_mask)
            if OUTPUT_MASS:  # the merged (global) normaliser, not any one split's
                tl.store(norm_max_ptr + row64 * num_q_heads + head, m_i, mask=row_ok)
                tl.store(norm_sum_ptr + row64 * num_q_heads + head, l_i, mask=row_ok)
            tl.store(counter, 0)  # every launch leaves the counters zero for the next one


@triton.jit
def _page_mass_kernel(query_start_ptr, num_live_ptr, norm_max_ptr, norm_sum_ptr, seg_lse_ptr, mass_ptr,
                      stride_mass, num_q_heads, max_segs,
                      GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, SEG: tl.constexpr,
                      CHUNK: tl.constexpr):
    """mass[seq, column] += sum over the group's heads and the column's segments of exp2(lse - max) / sum."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    row = tl.load(query_start_ptr + seq)
    num_q = tl.minimum(tl.load(query_start_ptr + seq + 1) - row, 1)
    num_segs = tl.load(num_live_ptr + seq) * num_q * (BLOCK_SIZE // SEG)
    g = tl.arange(0, GROUP_PAD)
    head = kv_head * GROUP + g
    row_ok = g < GROUP * num_q
    row64 = row.to(tl.int64)
    m_i = tl.load(norm_max_ptr + row64 * num_q_heads + head, mask=row_ok, other=0.0)
    l_i = tl.load(norm_sum_ptr + row64 * num_q_heads + head, mask=row_ok, other=0.0)
    inv_l = tl.where(row_ok & (l_i > 0), 1.0 / tl.where(l_i > 0, l_i, 1.0), 0.0)  # [GROUP_PAD]
    lse_rows = seg_lse_ptr + (row64 * num_q_heads + head)[:, None] * max_segs
    mass_row = mass_ptr + seq.to(tl.int64) * stride_mass
    for start in range(0, num_segs, CHUNK):
        seg = start + tl.arange(0, CHUNK)
        ok = seg < num_segs
        both = row_ok[:, None] & ok[None, :]
        lse = tl.load(lse_rows + seg[None, :], mask=both, other=float("-inf"))
        p = tl.where(both, tl.exp2(lse - m_i[:, None]) * inv_l[:, None], 0.0)
        tl.atomic_add(mass_row + seg * SEG // BLOCK_SIZE, tl.sum(p, 0), mask=ok)


_COUNTERS: dict[torch.device, list[torch.Tensor]] = {}


def split_counters(device: torch.device, n: int) -> torch.Tensor:
    """At least ``n`` zeroed int32 arrival counters (one per sequence x KV head) for split-K merging.

    One buffer per device, shared by every launch: each launch leaves its counters zero, so launches
    on one stream may share them (two streams decoding at once on one device may not). A buffer that
    is outgrown stays allocated, since captured CUDA graphs keep its address; growing one during
    capture is refused (graph capture must see the buffer it will replay with).
    """
    bufs = _COUNTERS.setdefault(device, [])
    if not bufs or bufs[-1].numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"decode split counters must grow to {n} during CUDA-graph capture: "
                               "run the same launch once before capturing it")
        bufs.append(torch.zeros(max(n, 2 * bufs[-1].numel() if bufs else 4096), dtype=torch.int32, device=device))
    return bufs[-1]


@dataclass(frozen=True)
class DecodeConfig:
    """Launch shape of the decode kernel: keys per tile, splits per sequence, warps, pipeline depth."""

    tile_n: int
    num_splits: int
    num_warps: int
    num_stages: int


@functools.lru_cache(maxsize=None)
def num_sms(device: torch.device) -> int:
    """Multiprocessors of a CUDA device; a small stand-in under the interpreter keeps grids small."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def choose_num_splits(programs: int, max_tiles: int, sms: int, programs_per_sm: int = 2,
                      min_tiles_per_split: int = 2, max_splits: int = 64) -> int:
    """Splits per sequence so ``programs * splits`` fills whole waves of ``sms * programs_per_sm`` slots.

    ``programs`` = sequences x KV heads. Efficiency of n splits = waves / ceil(waves); the smallest n
    within 90% of the best wins (fewer splits, less combine work). Each split keeps at least
    ``min_tiles_per_split`` tiles of the longest sequence.
    """
    slots = sms * programs_per_sm
    if programs >= slots or max_tiles <= 1:
        return 1
    cap = max(1, min(max_splits, max_tiles // min_tiles_per_split))
    efficiency = []
    for n in range(1, cap + 1):
        waves = programs * n / slots
        efficiency.append(waves / math.ceil(waves))
    best = max(efficiency)
    return next(n for n, e in enumerate(efficiency, start=1) if e >= 0.9 * best)


def decode_config(num_seqs: int, num_kv_heads: int, block_size: int, max_live_blocks: int, head_dim: int,
                  dtype: torch.dtype, device: torch.device) -> DecodeConfig:
    """Default launch shape, from the H200 sweeps in docs/notebook/benchmarks.md.

    bf16/fp16, by the number of (sequence, KV head) programs: enough to fill the GPU twice over
    (batch 256 at 8 KV heads) or very few (batch 1): 32 KB K tiles (128 keys at head dim 128),
    4 warps, 2 stages, splits filling two programs per multiprocessor. In between (batch 16-32):
    16 KB tiles, 2 warps, 3 stages — three light programs per multiprocessor keep more loads in
    flight than two heavy ones — and splits filling those three slots. fp32 (exact dot,
    register-hungry): ~16 KB tiles, 8 warps, 2 stages.
    """
    elem = torch.empty((), dtype=dtype).element_size()
    programs, sms = num_seqs * num_kv_heads, num_sms(device)
    small = elem < 4 and sms // 2 <= programs < 2 * sms
    tile_bytes = 16384 if elem == 4 or small else 32768
    tile_n = min(128, max(16, next_pow2(tile_bytes // (next_pow2(head_dim) * elem))))
    max_tiles = triton.cdiv(max_live_blocks * block_size, tile_n)
    splits = choose_num_splits(programs, max_tiles, sms, programs_per_sm=3 if small else 2)
    if elem == 4:
        return DecodeConfig(tile_n=tile_n, num_splits=splits, num_warps=8, num_stages=2)
    if small:
        return DecodeConfig(tile_n=tile_n, num_splits=splits, num_warps=2, num_stages=3)
    return DecodeConfig(tile_n=tile_n, num_splits=splits, num_warps=4, num_stages=2)


def decode_attention(q: torch.Tensor, cache: PagedKVCache, layer: int, meta: AttentionMetadata, scale: float,
                     config: DecodeConfig | None = None, out: torch.Tensor | None = None,
                     mass: torch.Tensor | None = None, pdl: bool = False) -> torch.Tensor:
    """Attention of ``q [S, H_q, D]`` (one token per sequence) over live blocks; returns ``[S, H_q, D]``.

    ``config`` overrides the launch shape; pass a fixed ``num_splits`` when capturing a CUDA graph
    (the default split count depends on ``meta.max_live_blocks``). ``out`` receives the result when
    given. A query with no visible key gets 0; rows no sequence owns (past ``query_start[S]``, e.g.
    padding of a captured batch) are left unwritten. ``mass``: a float32 ``[S, >= M]`` buffer that
    receives, added to what it holds, each block-table column's attention probability summed over
    query heads (the module docstring; ``kernels.reference`` defines the same output). ``pdl``: part of a
    PDL chain (``kernels.pdl``): the kernel prefetches its K/V lines into L2 before it waits.
    """
    k, v = check_attention(q, cache, layer, meta)
    if not meta.is_decode:
        raise ValueError(f"decode_attention needs one query per sequence, got max_query_len={meta.max_query_len}")
    n, h_q, dim = q.shape
    _, block_size, h_kv, _ = k.shape
    cfg = config or decode_config(meta.num_seqs, h_kv, block_size, meta.max_live_blocks, dim, q.dtype, q.device)
    _check_config(cfg)
    out = output_buffer(q, out)
    if n == 0 or meta.num_seqs == 0:
        return out
    group = h_q // h_kv
    dim_pad = max(16, next_pow2(dim))
    splits = cfg.num_splits
    part_acc = torch.empty((n, h_q, splits, dim_pad) if splits > 1 else (1,), dtype=torch.float32, device=q.device)
    part_max = torch.empty((n, h_q, splits) if splits > 1 else (1,), dtype=torch.float32, device=q.device)
    part_sum = torch.empty_like(part_max)
    counters = split_counters(q.device, meta.num_seqs * h_kv) if splits > 1 else part_max
    seg = math.gcd(cfg.tile_n, block_size)  # a power of two: a segment lies in one tile and one block
    max_segs = triton.cdiv(meta.block_tables.shape[1] * block_size, cfg.tile_n) * (cfg.tile_n // seg)
    if mass is not None:
        _check_mass(mass, meta, q.device)
        norm_max = torch.empty((n, h_q), dtype=torch.float32, device=q.device)
        norm_sum = torch.empty_like(norm_max)
        seg_lse = torch.empty((n, h_q, max_segs), dtype=torch.float32, device=q.device)
    else:
        norm_max = norm_sum = seg_lse = part_max
    grid = (meta.num_seqs, h_kv, splits)
    shape = dict(GROUP=group, GROUP_PAD=max(16, next_pow2(group)), HEAD_DIM=dim, DIM_PAD=dim_pad,
                 BLOCK_SIZE=block_size, TILE_N=cfg.tile_n, NUM_SPLITS=splits,
                 PRECISION="ieee" if q.dtype == torch.float32 else None, UPCAST=interpreting(),
                 num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    pdl = check_pdl(pdl, q.device)
    line = line_elems(k.dtype)
    kill = meta.kill
    if kill is not None and (kill.dtype != torch.int32 or tuple(kill.shape) != (meta.num_seqs, 2)
                             or not kill.is_contiguous() or kill.device != q.device):
        raise ValueError(f"meta.kill must be a contiguous int32 [{meta.num_seqs}, 2] tensor on {q.device}, got "
                         f"{kill.dtype} {tuple(kill.shape)} on {kill.device}")
    _decode_kernel[grid](
        q, k, v, cache.death, meta.block_tables, meta.block_index, meta.num_live_blocks,
        meta.query_start, meta.query_pos, kill if kill is not None else meta.query_pos,  # (KILL off: never read)
        out, part_acc, part_max, part_sum, counters, norm_max, norm_sum, seg_lse,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2),
        meta.block_tables.stride(0), meta.block_index.stride(0), out.stride(0), out.stride(1), h_q, h_kv,
        scale * LOG2E, max_segs, OUTPUT_MASS=mass is not None, SEG=seg, SEGS_PER_TILE=cfg.tile_n // seg,
        PDL=pdl, LINE=line, LINES_PAD=next_pow2(triton.cdiv(dim, line)), KILL=kill is not None, **shape,
        **launch_options(pdl))
    if mass is not None:
        _page_mass_kernel[(meta.num_seqs, h_kv)](
            meta.query_start, meta.num_live_blocks, norm_max, norm_sum, seg_lse, mass, mass.stride(0), h_q, max_segs,
            GROUP=group, GROUP_PAD=shape["GROUP_PAD"], BLOCK_SIZE=block_size, SEG=seg, CHUNK=128, num_warps=4)
    return out


def _check_mass(mass: torch.Tensor, meta: AttentionMetadata, device: torch.device) -> None:
    width = meta.block_tables.shape[1]
    if mass.dtype != torch.float32 or mass.dim() != 2 or mass.shape[0] < meta.num_seqs or mass.shape[1] < width \
            or mass.stride(1) != 1 or mass.device != device:
        raise ValueError(f"mass must be a float32 [S >= {meta.num_seqs}, M >= {width}] tensor with contiguous rows "
                         f"on {device}, got {mass.dtype} {tuple(mass.shape)} strides {mass.stride()} on {mass.device}")


def _check_config(cfg: DecodeConfig) -> None:
    if cfg.tile_n < 16 or cfg.tile_n & (cfg.tile_n - 1):
        raise ValueError(f"decode tile_n must be a power of two >= 16 (tl.dot minimum), got {cfg.tile_n}")
    if cfg.num_splits < 1:
        raise ValueError(f"decode num_splits must be >= 1, got {cfg.num_splits}")
