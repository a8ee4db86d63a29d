"""Prefill / chunked-prefill attention: several query tokens per sequence (varlen) over live blocks.

Program (sequence s, query tile t, KV head h) holds ``BLOCK_Q`` query tokens times the GQA group of
h as the rows of one ``[BLOCK_Q * GROUP_PAD, D]`` tile (row r = token ``r // GROUP_PAD``, head
``r % GROUP_PAD``), so K/V are read once per group. It walks s's live-key tiles, skips a tile no
row can see (every key after the tile's last query, or dead before its first), and masks the rest
slot by slot with ``k <= q < death``. The new tokens' K/V are already in the cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from sliderl.kernels.key_tile import EMPTY_MAX, LOG2E, live_key_tile
from sliderl.kernels.launch_checks import check_attention, interpreting, next_pow2, output_buffer
from sliderl.kernels.metadata import AttentionMetadata, PagedKVCache

INT32_MAX = tl.constexpr(2**31 - 1)


@triton.jit
def _prefill_kernel(q_ptr, k_ptr, v_ptr, death_ptr, block_tables_ptr, block_index_ptr, num_live_ptr,
                    query_start_ptr, query_pos_ptr, out_ptr,
                    stride_qn, stride_qh, stride_kb, stride_ks, stride_kh,
                    stride_bt, stride_bi, stride_on, stride_oh, scale_log2,
                    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
                    HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
                    PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    seq = tl.program_id(0)
    q_tile = tl.program_id(1)
    kv_head = tl.program_id(2)
    start = tl.load(query_start_ptr + seq)
    num_q = tl.load(query_start_ptr + seq + 1) - start

    r = tl.arange(0, BLOCK_Q * GROUP_PAD)
    tok = q_tile * BLOCK_Q + r // GROUP_PAD
    g = r % GROUP_PAD
    row_ok = (tok < num_q) & (g < GROUP)  # [BLOCK_M]
    head = kv_head * GROUP + g
    row = (start + tok).to(tl.int64)
    d = tl.arange(0, DIM_PAD)
    d_ok = d < HEAD_DIM
    q_mask = row_ok[:, None] & d_ok[None, :]
    q = tl.load(q_ptr + row[:, None] * stride_qn + head[:, None] * stride_qh + d[None, :], mask=q_mask, other=0.0)
    if UPCAST:  # the interpreter multiplies bf16 as integers: run its dots in fp32
        q = q.to(tl.float32)
    q_pos = tl.load(query_pos_ptr + row, mask=row_ok, other=0)
    q_lo = tl.min(tl.where(row_ok, q_pos, INT32_MAX), 0)
    q_hi = tl.max(tl.where(row_ok, q_pos, -1), 0)

    m_i = tl.full([BLOCK_Q * GROUP_PAD], EMPTY_MAX, tl.float32)
    l_i = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_PAD, DIM_PAD], tl.float32)
    num_live = tl.load(num_live_ptr + seq) * (q_tile * BLOCK_Q < num_q).to(tl.int32)
    num_tiles = tl.cdiv(num_live * BLOCK_SIZE, TILE_N)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    bi_row = block_index_ptr + seq.to(tl.int64) * stride_bi
    for tile in range(0, num_tiles):
        offset, pos, death, in_range = live_key_tile(bt_row, bi_row, death_ptr, num_live, tile,
                                                     stride_kb, stride_ks, BLOCK_SIZE, TILE_N)
        reachable = in_range & (pos <= q_hi) & (death > q_lo)  # [TILE_N]: some row of the tile may see it
        if tl.max(reachable.to(tl.int32), 0) > 0:
            kv_mask = reachable[:, None] & d_ok[None, :]
            k = tl.load(k_ptr + offset[:, None] + kv_head * stride_kh + d[None, :], mask=kv_mask, other=0.0)
            v = tl.load(v_ptr + offset[:, None] + kv_head * stride_kh + d[None, :], mask=kv_mask, other=0.0)
            if UPCAST:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            visible = reachable[None, :] & (pos[None, :] <= q_pos[:, None]) & (q_pos[:, None] < death[None, :])
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # [BLOCK_M, TILE_N]
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=PRECISION)
            m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    out_ptrs = out_ptr + row[:, None] * stride_on + head[:, None] * stride_oh + d[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=q_mask)


@dataclass(frozen=True)
class PrefillConfig:
    """Launch shape of the prefill kernel: query tokens and keys per tile, warps, pipeline depth."""

    block_q: int
    tile_n: int
    num_warps: int
    num_stages: int


def prefill_config(max_query_len: int, group: int, head_dim: int, dtype: torch.dtype) -> PrefillConfig:
    """Default: 64 rows (query tokens x padded group, >= 16 for ``tl.dot``) x 64 keys, 4 warps.

    fp32 (exact dot, no tensor cores, register-hungry): 16 rows x 32 keys on 8 warps. D > 128: 32 keys.
    """
    group_pad = next_pow2(group)
    fp32 = dtype == torch.float32
    rows = max(16 if fp32 else 64, group_pad)
    block_q = max(min(rows // group_pad, next_pow2(max_query_len)), triton.cdiv(16, group_pad))
    tile_n = 32 if fp32 or head_dim > 128 else 64
    return PrefillConfig(block_q=block_q, tile_n=tile_n, num_warps=8 if fp32 else 4, num_stages=2)


def prefill_attention(q: torch.Tensor, cache: PagedKVCache, layer: int, meta: AttentionMetadata, scale: float,
                      config: PrefillConfig | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of ``q [N, H_q, D]`` (varlen tokens per sequence) over live blocks; returns ``[N, H_q, D]``.

    Works for any ``max_query_len`` (decode included). ``out`` receives the result when given. A query
    with no visible key gets 0; rows no sequence owns are left unwritten.
    """
    k, v = check_attention(q, cache, layer, meta)
    n, h_q, dim = q.shape
    _, block_size, h_kv, _ = k.shape
    group = h_q // h_kv
    cfg = config or prefill_config(meta.max_query_len, group, dim, q.dtype)
    _check_config(cfg, group)
    out = output_buffer(q, out)
    if n == 0 or meta.num_seqs == 0 or meta.max_query_len == 0:
        return out
    grid = (meta.num_seqs, triton.cdiv(meta.max_query_len, cfg.block_q), h_kv)
    _prefill_kernel[grid](
        q, k, v, cache.death, meta.block_tables, meta.block_index, meta.num_live_blocks,
        meta.query_start, meta.query_pos, out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2),
        meta.block_tables.stride(0), meta.block_index.stride(0), out.stride(0), out.stride(1), scale * LOG2E,
        GROUP=group, GROUP_PAD=next_pow2(group), BLOCK_Q=cfg.block_q, HEAD_DIM=dim, DIM_PAD=max(16, next_pow2(dim)),
        BLOCK_SIZE=block_size, TILE_N=cfg.tile_n,
        PRECISION="ieee" if q.dtype == torch.float32 else None, UPCAST=interpreting(),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out


def _check_config(cfg: PrefillConfig, group: int) -> None:
    rows = cfg.block_q * next_pow2(group)
    if cfg.block_q < 1 or cfg.block_q & (cfg.block_q - 1) or rows < 16:
        raise ValueError(f"prefill block_q must be a power of two with block_q x group >= 16, got {cfg.block_q} (group {group})")
    if cfg.tile_n < 16 or cfg.tile_n & (cfg.tile_n - 1):
        raise ValueError(f"prefill tile_n must be a power of two >= 16 (tl.dot minimum), got {cfg.tile_n}")
