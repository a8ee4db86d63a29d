"""Argument checks every Triton launcher runs before launching: shapes, dtypes, strides, devices.

A bad argument raises ``ValueError`` naming the tensor, what it was and what would be valid; nothing
here synchronises with the device, so the launchers stay usable under CUDA-graph capture.
"""

from __future__ import annotations

import os

import torch

from sliderl.kernels.metadata import AttentionMetadata, PagedKVCache

KV_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INT32_FIELDS = ("query_start", "query_pos", "slot_death", "block_tables", "block_index", "num_live_blocks")


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def check_layer(cache: PagedKVCache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's K/V pools ``[num_blocks, block_size, H_kv, D]`` after checking them."""
    if not 0 <= layer < len(cache.k):
        raise ValueError(f"layer {layer} out of range: the cache holds {len(cache.k)} layers (0..{len(cache.k) - 1})")
    k, v = cache.k[layer], cache.v[layer]
    if k.dim() != 4 or k.shape != v.shape:
        raise ValueError(f"cache K/V of layer {layer} must both be [num_blocks, block_size, H_kv, D], "
                         f"got {tuple(k.shape)} and {tuple(v.shape)}")
    if k.dtype != v.dtype or k.dtype not in KV_DTYPES:
        raise ValueError(f"cache K/V dtype must be one of {KV_DTYPES} and equal, got {k.dtype} and {v.dtype}")
    if k.stride(-1) != 1 or k.stride() != v.stride():
        raise ValueError(f"cache K/V must share strides with a contiguous head dim, got {k.stride()} and {v.stride()}")
    death = cache.death
    if death.shape != k.shape[:2] or death.dtype != torch.int32 or not death.is_contiguous():
        raise ValueError(f"cache.death must be a contiguous int32 [num_blocks, block_size] = {tuple(k.shape[:2])}, "
                         f"got {death.dtype} {tuple(death.shape)} contiguous={death.is_contiguous()}")
    _same_device("cache", [k, v, death])
    return k, v


def check_metadata(meta: AttentionMetadata, num_tokens: int, device: torch.device) -> None:
    """Dtypes, shapes and device of the metadata for a batch of ``num_tokens`` query tokens."""
    for name in INT32_FIELDS:
        t = getattr(meta, name)
        if t.dtype != torch.int32:
            raise ValueError(f"meta.{name} must be int32, got {t.dtype}")
    if meta.slot_mapping.dtype != torch.int64:
        raise ValueError(f"meta.slot_mapping must be int64, got {meta.slot_mapping.dtype}")
    for name in ("query_pos", "slot_mapping", "slot_death"):
        if getattr(meta, name).shape != (num_tokens,):
            raise ValueError(f"meta.{name} must be [{num_tokens}] (one per query token), got {tuple(getattr(meta, name).shape)}")
    s = meta.num_seqs
    if meta.block_tables.dim() != 2 or meta.block_tables.shape[0] != s or meta.block_index.shape != meta.block_tables.shape:
        raise ValueError(f"meta.block_tables and meta.block_index must both be [S={s}, M], "
                         f"got {tuple(meta.block_tables.shape)} and {tuple(meta.block_index.shape)}")
    if meta.block_tables.stride(1) != 1 or meta.block_index.stride(1) != 1:
        raise ValueError("meta.block_tables and meta.block_index rows must be contiguous")
    if meta.num_live_blocks.shape != (s,):
        raise ValueError(f"meta.num_live_blocks must be [S={s}], got {tuple(meta.num_live_blocks.shape)}")
    for name, t in vars(meta).items():
        if isinstance(t, torch.Tensor) and t.device != device:
            raise ValueError(f"meta.{name} is on {t.device} but the queries/cache are on {device}")


def check_tokens(name: str, x: torch.Tensor, num_heads: int | None, head_dim: int, device: torch.device) -> None:
    """A per-token tensor ``[N, H, D]`` with a contiguous head dim on ``device``."""
    if x.dim() != 3 or x.shape[2] != head_dim or (num_heads is not None and x.shape[1] != num_heads):
        want = f"[N, {num_heads if num_heads is not None else 'H'}, {head_dim}]"
        raise ValueError(f"{name} must be {want}, got {tuple(x.shape)}")
    if x.stride(-1) != 1:
        raise ValueError(f"{name} head dim must be contiguous (stride 1), got strides {x.stride()}")
    if x.device != device:
        raise ValueError(f"{name} is on {x.device} but the cache is on {device}")


def check_attention(q: torch.Tensor, cache: PagedKVCache, layer: int, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """All checks for an attention call; returns the layer's K/V pools."""
    k, v = check_layer(cache, layer)
    check_tokens("q", q, None, k.shape[3], k.device)
    if q.dtype != k.dtype:
        raise ValueError(f"q dtype {q.dtype} must equal the cache dtype {k.dtype}")
    h_q, h_kv = q.shape[1], k.shape[2]
    if h_q % h_kv != 0:
        raise ValueError(f"query heads ({h_q}) must be a multiple of KV heads ({h_kv}) for GQA")
    check_metadata(meta, q.shape[0], k.device)
    return k, v


def output_buffer(q: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """``out`` checked to match q (shape, dtype, device, contiguous head dim), or a fresh one."""
    if out is None:
        return torch.empty_like(q)
    if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device or out.stride(-1) != 1:
        raise ValueError(f"out must match q: {q.dtype} {tuple(q.shape)} on {q.device} with a contiguous head dim, "
                         f"got {out.dtype} {tuple(out.shape)} on {out.device} with strides {out.stride()}")
    return out


def _same_device(what: str, tensors: list[torch.Tensor]) -> None:
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"{what} tensors are on several devices: {sorted(map(str, devices))}")
