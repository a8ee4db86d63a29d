"""Attention of a denoising forward: the spans of several requests over their requests' KV in the paged pool.

A denoising step runs the model over every token of the rounds being denoised (their ``<async>``, body and
``</async>``, a body position ``<mask>`` until revealed). A span token attends to its request's cached keys —
the context and the plan through its own promise (positions up to its promise's ``/>``, the span's *view*;
``core.planned_diffusion``) — and to every token of its own span, in both directions, computed in this forward;
never to another span (DESIGN.md, "Planned Diffusion spans"). The cached keys are read from the pool through the
request's block table; the span's own keys are the forward's. A *commit* forward is the same over the finished
spans, and also writes their K/V into the pool at their slots, where autoregression after the ``<sync/>`` reads
them with the engine's kernels.

The requests form one padded batch: queries ``[R, S, H, D]`` (S the most span tokens of a request) against keys
``[R, L + S, H_kv, D]`` (L the longest prefix), one ``scaled_dot_product_attention`` with a bool mask per layer
(GQA-aware). Pad rows see one key and are dropped. A batch may also be padded further, to a bucket's shape, for a
captured CUDA graph (``SpanBatch.build``'s ``bucket``, ``span_graphs``); the mask is computed from the batch's
tensors when ``SpanAttention`` is made, so a graph that makes it inside its capture recomputes it on replay.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch import Tensor

from sliderl.core.kv_policy import NEVER
from sliderl.kernels.metadata import PagedKVCache


@dataclass(frozen=True)
class SpanBatch:
    """One denoising (or commit) forward's layout, on the device. N span tokens of R requests, flattened."""

    prefix_slots: Tensor  # [R, L] int64 pool slots of each request's cached positions 0..L_r-1, 0 pad
    views: Tensor  # [R, S] int64 the last cached position each padded query slot sees (-1 pad)
    gather: Tensor  # [R, S] int64 flat token index of each padded query slot (pads repeat the request's first)
    query_valid: Tensor  # [R, S] bool
    scatter: Tensor  # [N] int64 index into the flattened [R * S] slots of each token
    span_ids: Tensor  # [R, S] int64 span id of each padded slot (-1 pad)
    write_slots: Tensor | None  # [N] int64 pool slots the K/V go to (commit), None (denoising)

    @classmethod
    def build(cls, prefix_slots: list[list[int]], span_ids: list[list[int]], views: list[list[int]],
              device: torch.device, write_slots: list[int] | None = None,
              bucket: tuple[int, int, int] | None = None) -> SpanBatch:
        """``prefix_slots[r]``: the pool slots of request r's cached positions in order; ``span_ids[r]`` and
        ``views[r]``: its span tokens' span ids (tokens of one span share an id) and views, in flattened order;
        ``write_slots``: commit only.

        ``bucket``: (R', S', L'), at least the exact (R, S, L), pads the batch to that shape (``span_graphs``):
        rows past R are pad requests (every slot a pad query, prefix slots 0), prefix columns past a request's
        own lie past all its views, and the flat stream is R' * S' tokens, the N span tokens first, then pad
        tokens that no query sees (each takes slot 0's output, which is dropped)."""
        r = len(span_ids)
        width, longest = max(len(s) for s in span_ids), max(1, max(len(p) for p in prefix_slots))
        if bucket is not None:
            assert bucket[0] >= r and bucket[1] >= width and bucket[2] >= longest, (bucket, (r, width, longest))
            r, width, longest = bucket
        slots = torch.zeros(r, longest, dtype=torch.int64)
        seen = torch.full((r, width), -1, dtype=torch.int64)
        gather = torch.zeros(r, width, dtype=torch.int64)
        ids = torch.full((r, width), -1, dtype=torch.int64)
        scatter, start = [], 0
        for i, (prefix, spans, view) in enumerate(zip(prefix_slots, span_ids, views)):
            slots[i, :len(prefix)] = torch.tensor(prefix, dtype=torch.int64)
            seen[i, :len(view)] = torch.tensor(view, dtype=torch.int64)
            gather[i] = start
            gather[i, :len(spans)] = torch.arange(start, start + len(spans))
            ids[i, :len(spans)] = torch.tensor(spans, dtype=torch.int64)
            scatter.extend(range(i * width, i * width + len(spans)))
            start += len(spans)
        if bucket is not None:
            scatter.extend([0] * (r * width - start))  # pad tokens
        writes = None if write_slots is None else torch.tensor(write_slots, dtype=torch.int64)
        return cls(slots, seen, gather, ids >= 0, torch.tensor(scatter, dtype=torch.int64), ids, writes).to(device)

    def to(self, device: torch.device) -> SpanBatch:
        """This batch (built on the host) on ``device``; to CUDA from pinned memory, so the host does not wait."""
        if device.type == "cpu":
            return self
        tensors = (getattr(self, f.name) for f in fields(self))
        return SpanBatch(*(None if x is None else x.pin_memory().to(device, non_blocking=True) for x in tensors))

    def copy_(self, other: SpanBatch) -> None:
        """Copy ``other`` (the same shape, on the host) into this batch's tensors: a captured graph's inputs."""
        for f in fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if mine is not None:
                mine.copy_(theirs.pin_memory() if mine.is_cuda else theirs, non_blocking=True)

    def mask(self) -> Tensor:
        """``[R, S, L + S]`` bool: a valid query sees its request's cached keys up to its view and its own span's
        tokens; a pad query sees its request's first key only."""
        own = (self.span_ids[:, :, None] == self.span_ids[:, None, :]) & self.query_valid[:, None, :]
        position = torch.arange(self.prefix_slots.shape[1], device=own.device)
        seen = torch.cat([position[None, None, :] <= self.views[:, :, None], own], dim=2)
        first = torch.zeros_like(seen)
        first[:, :, 0] = True
        return torch.where(self.query_valid[:, :, None], seen, first)


class SpanAttention:
    """The ``AttentionBackend`` of a denoising or commit forward (module docstring)."""

    def __init__(self, cache: PagedKVCache, batch: SpanBatch, scale: float):
        self.cache, self.batch, self.scale = cache, batch, scale
        self._mask = batch.mask()[:, None]  # [R, 1, S, L + S]

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """q: [N, H_q, D], k/v: [N, H_kv, D] -> [N, H_q, D]."""
        b, kc, vc = self.batch, self.cache.k[layer], self.cache.v[layer]
        if b.write_slots is not None:
            kc.view(-1, *kc.shape[2:]).index_copy_(0, b.write_slots, k.to(kc.dtype))
            vc.view(-1, *vc.shape[2:]).index_copy_(0, b.write_slots, v.to(vc.dtype))
            if layer == 0:
                self.cache.death.view(-1).index_fill_(0, b.write_slots, NEVER)
        prefix_k = kc.view(-1, *kc.shape[2:])[b.prefix_slots].to(q.dtype)  # [R, L, H_kv, D]
        prefix_v = vc.view(-1, *vc.shape[2:])[b.prefix_slots].to(q.dtype)
        keys = torch.cat([prefix_k, k[b.gather]], dim=1).transpose(1, 2)  # [R, H_kv, L + S, D]
        values = torch.cat([prefix_v, v[b.gather]], dim=1).transpose(1, 2)
        out = F.scaled_dot_product_attention(q[b.gather].transpose(1, 2), keys, values, attn_mask=self._mask,
                                             scale=self.scale, enable_gqa=True)  # [R, H_q, S, D]
        return out.transpose(1, 2).flatten(0, 1)[b.scatter]
