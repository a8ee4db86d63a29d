"""Cache write: store the new tokens' K/V ``[N, H_kv, D]`` into their slots; layer 0 also stores deaths.

Same semantics as ``kernels.reference.write_kv``: token n goes to flat slot ``slot_mapping[n]``
(block ``slot // block_size``, offset ``slot % block_size``). A negative slot marks a padding
token and is skipped. One program per token writes all its heads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sliderl.kernels.launch_checks import check_layer, check_tokens, next_pow2
from sliderl.kernels.metadata import AttentionMetadata, PagedKVCache
from sliderl.kernels.pdl import check_pdl, launch_options, wait_then_release


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, slot_mapping_ptr, slot_death_ptr, k_cache_ptr, v_cache_ptr, death_ptr,
                     stride_kn, stride_kh, stride_vn, stride_vh, stride_cb, stride_cs, stride_ch,
                     NUM_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
                     BLOCK_SIZE: tl.constexpr, WRITE_DEATH: tl.constexpr, PDL: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    wait_then_release(PDL)
    slot = tl.load(slot_mapping_ptr + tok)
    live = slot >= 0
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    h = tl.arange(0, HEADS_PAD)
    d = tl.arange(0, DIM_PAD)
    mask = (h[:, None] < NUM_HEADS * live.to(tl.int32)) & (d[None, :] < HEAD_DIM)  # all off for a padding token
    k = tl.load(k_ptr + tok * stride_kn + h[:, None] * stride_kh + d[None, :], mask=mask)
    v = tl.load(v_ptr + tok * stride_vn + h[:, None] * stride_vh + d[None, :], mask=mask)
    dst = block * stride_cb + offset * stride_cs + h[:, None] * stride_ch + d[None, :]  # int64
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)
    if WRITE_DEATH:
        tl.store(death_ptr + slot, tl.load(slot_death_ptr + tok), mask=live)


def write_kv(cache: PagedKVCache, layer: int, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
             pdl: bool = False) -> None:
    """Store ``k, v [N, H_kv, D]`` at ``meta.slot_mapping`` (cast to the cache dtype); layer 0 stores ``meta.slot_death``.
    ``pdl``: part of a PDL chain (``kernels.pdl``)."""
    k_cache, v_cache = check_layer(cache, layer)
    _, block_size, h_kv, dim = k_cache.shape
    check_tokens("k", k, h_kv, dim, k_cache.device)
    check_tokens("v", v, h_kv, dim, k_cache.device)
    n = k.shape[0]
    if v.shape[0] != n:
        raise ValueError(f"k and v must hold the same tokens, got {n} and {v.shape[0]}")
    slots, deaths = meta.slot_mapping, meta.slot_death
    if slots.shape != (n,) or slots.dtype != torch.int64 or deaths.shape != (n,) or deaths.dtype != torch.int32:
        raise ValueError(f"meta.slot_mapping must be int64 [{n}] and meta.slot_death int32 [{n}], got "
                         f"{slots.dtype} {tuple(slots.shape)} and {deaths.dtype} {tuple(deaths.shape)}")
    if slots.device != k_cache.device or deaths.device != k_cache.device:
        raise ValueError(f"meta.slot_mapping/slot_death must be on the cache device {k_cache.device}")
    if n == 0:
        return
    k, v = k.to(k_cache.dtype), v.to(v_cache.dtype)  # torch's rounding, as the reference (a no-op when equal)
    _write_kv_kernel[(n,)](
        k, v, slots, deaths, k_cache, v_cache, cache.death,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_HEADS=h_kv, HEADS_PAD=next_pow2(h_kv), HEAD_DIM=dim, DIM_PAD=next_pow2(dim),
        BLOCK_SIZE=block_size, WRITE_DEATH=layer == 0, PDL=check_pdl(pdl, k.device), num_warps=4,
        **launch_options(pdl))
