"""Pure-torch paged attention: the CPU path of the engine and the reference the Triton kernels match."""

from __future__ import annotations

import torch

from kernels.metadata import AttentionMetadata, PagedKVCache


def write_kv(cache: PagedKVCache, layer: int, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
    """Store new keys/values (``[N, H_kv, D]``) at ``meta.slot_mapping``; layer 0 also stores their death."""
    kc, vc = cache.k[layer], cache.v[layer]
    slots = meta.slot_mapping
    kc.view(-1, *kc.shape[2:]).index_copy_(0, slots, k.to(kc.dtype))
    vc.view(-1, *vc.shape[2:]).index_copy_(0, slots, v.to(vc.dtype))
    if layer == 0:
        cache.death.view(-1).index_copy_(0, slots, meta.slot_death)


def gather_live(cache: PagedKVCache, layer: int, meta: AttentionMetadata, s: int):
    """Keys, values, positions and deaths of sequence s's live blocks: ``[L, H_kv, D]`` x2, ``[L]`` x2."""
    n = int(meta.num_live_blocks[s])
    blocks = meta.block_tables[s, :n].long()
    bs = cache.block_size
    pos = (meta.block_index[s, :n].long()[:, None] * bs + torch.arange(bs, device=blocks.device)).reshape(-1)
    k = cache.k[layer][blocks].reshape(n * bs, *cache.k[layer].shape[2:])
    v = cache.v[layer][blocks].reshape(n * bs, *cache.v[layer].shape[2:])
    death = cache.death[blocks].reshape(-1).long()
    return k, v, pos, death


def paged_attention(q: torch.Tensor, cache: PagedKVCache, layer: int, meta: AttentionMetadata, scale: float,
                    acc_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Attention of ``q [N, H_q, D]`` over each sequence's live blocks; returns ``[N, H_q, D]`` in q's dtype.

    Query at position p reads slot key k (position pk) when ``pk <= p < death``. GQA: query head h
    reads KV head ``h // (H_q // H_kv)``. Softmax and products run in ``acc_dtype``.
    """
    out = torch.empty_like(q)
    starts = meta.query_start.tolist()
    h_q, h_kv = q.shape[1], cache.k[layer].shape[2]
    for s in range(meta.num_seqs):
        a, b = starts[s], starts[s + 1]
        if a == b:
            continue
        k, v, k_pos, k_death = gather_live(cache, layer, meta, s)
        q_pos = meta.query_pos[a:b].long()[:, None]
        mask = (k_pos[None, :] <= q_pos) & (q_pos < k_death[None, :])  # [n_q, L]
        k = k.to(acc_dtype).repeat_interleave(h_q // h_kv, dim=1)  # [L, H_q, D]
        v = v.to(acc_dtype).repeat_interleave(h_q // h_kv, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[a:b].to(acc_dtype), k) * scale
        scores = scores.masked_fill(~mask[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[a:b] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
    return out
