"""Pure-torch paged attention: the CPU path of the engine and the reference the Triton kernels match.

``mass`` (Paged H2O, optional): a float32 ``[S, M]`` buffer, one entry per block-table column; each
call adds, for every query of sequence s, the attention probability its heads give each live block's
keys (summed over query heads and queries). One block table serves every layer, so calling it for
each layer accumulates the mass over layers too.
"""

from __future__ import annotations

import torch

from sliderl.kernels.metadata import AttentionMetadata, PagedKVCache


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
                    acc_dtype: torch.dtype = torch.float32, mass: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of ``q [N, H_q, D]`` over each sequence's live blocks; returns ``[N, H_q, D]`` in q's dtype.

    Query at position p reads slot key k (position pk) when ``pk <= p < death``. GQA: query head h
    reads KV head ``h // (H_q // H_kv)``. Softmax and products run in ``acc_dtype``. ``mass [S, M]``:
    see the module docstring.
    """
    if meta.is_decode:
        return decode_attention(q, cache, layer, meta, scale, acc_dtype, mass)
    if meta.kill is not None:
        raise ValueError("AttentionMetadata.kill is a decode step's (one query per sequence), got "
                         f"max_query_len={meta.max_query_len}")
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
        if mass is not None:  # [H_q, n_q, L] -> per live block (L = n · B)
            n = int(meta.num_live_blocks[s])
            mass[s, :n] += probs.sum((0, 1)).view(n, -1).sum(1).nan_to_num(0.0).to(mass.dtype)
    return out


def decode_attention(q: torch.Tensor, cache: PagedKVCache, layer: int, meta: AttentionMetadata, scale: float,
                     acc_dtype: torch.dtype = torch.float32, mass: torch.Tensor | None = None) -> torch.Tensor:
    """``paged_attention`` for one query per sequence, all sequences at once: ``q [S, H_q, D]`` -> ``[S, H_q, D]``.

    Every sequence's live blocks are gathered into ``[S, M·B]`` key slots (M = the most live blocks of
    any sequence; a padded block, id -1, is masked out), so the work is a few batched ops whatever S.
    Slots a query does not see contribute nothing, whatever they hold (values are zeroed, not just
    weighted by 0, so stale or NaN slots cannot leak); a sequence that sees no key gets 0. Without ``mass``
    the scores, softmax and product are one fused ``scaled_dot_product_attention``.
    """
    s, h_q, d = q.shape
    h_kv = cache.k[layer].shape[2]
    blocks, visible = decode_visibility(cache, meta, layer)
    hidden = ~visible[:, :, None, None]
    k = cache.k[layer][blocks].reshape(s, -1, h_kv, d).to(acc_dtype)  # [S, L, H_kv, D]
    v = cache.v[layer][blocks].reshape(s, -1, h_kv, d).to(acc_dtype).masked_fill(hidden, 0.0)
    if mass is None:  # query head h reads KV head h // (H_q // H_kv): enable_gqa; a NaN key must not reach a score
        k = k.masked_fill(hidden, 0.0)
        out = torch.nn.functional.scaled_dot_product_attention(
            q.to(acc_dtype)[:, :, None, :], k.transpose(1, 2), v.transpose(1, 2), attn_mask=visible[:, None, None, :],
            scale=scale, enable_gqa=True)  # [S, H_q, 1, D]; a row with no visible key: NaN -> 0 below
        return out.reshape(s, h_q, d).nan_to_num(0.0).to(q.dtype)
    qg = q.to(acc_dtype).view(s, h_kv, h_q // h_kv, d)
    scores = torch.einsum("skgd,slkd->skgl", qg, k) * scale  # [S, H_kv, G, L]
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a row with no visible key: all -inf -> 0
    out = torch.einsum("skgl,slkd->skgd", probs, v)  # [S, H_kv, G, D]
    # [S, H_kv, G, M·B] -> [S, M]; padded columns get 0
    mass[:, :blocks.shape[1]] += probs.sum((1, 2)).view(s, -1, cache.block_size).sum(2).to(mass.dtype)
    return out.reshape(s, h_q, d).to(q.dtype)


def decode_visibility(cache: PagedKVCache, meta: AttentionMetadata, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The decode step's gather ids ``[S, M]`` (padding clamped to block 0) and ``visible [S, M·B]`` (slot
    ``pk <= p < death`` of a live block): the same for every layer, so computed at layer 0's call (which has
    written the step's deaths by then; every forward starts there, so a meta run twice is never served an earlier
    forward's mask) and kept in ``meta.scratch`` for the other layers."""
    memo = meta.scratch.get("decode_visibility")
    if layer != 0 and memo is not None and memo[0] is cache:
        return memo[1]
    s, bs = meta.num_seqs, cache.block_size
    tables = meta.block_tables[:, :meta.max_live_blocks].long()  # [S, M], -1 pad
    blocks = tables.clamp(min=0)
    offsets = torch.arange(bs, device=tables.device)
    k_pos = (meta.block_index[:, :meta.max_live_blocks].long()[:, :, None] * bs + offsets).reshape(s, -1)  # [S, L]
    k_death = cache.death[blocks].reshape(s, -1).long()
    q_pos = meta.query_pos.long()[:, None]  # [S, 1]
    visible = (tables >= 0)[:, :, None].expand(-1, -1, bs).reshape(s, -1) & (k_pos <= q_pos) & (q_pos < k_death)
    if meta.kill is not None:  # a pending register kill (metadata.register_kills): [lo, hi) is dead already
        lo, hi = meta.kill.long().unbind(1)
        visible &= (k_pos < lo[:, None]) | (k_pos >= hi[:, None])
    meta.scratch["decode_visibility"] = (cache, (blocks, visible))
    return blocks, visible
