"""Turns a scheduled batch into tensors, runs the model over the paged cache, returns logits."""

from __future__ import annotations

import math

import torch

import kernels.reference as torch_attention
from kernels.metadata import AttentionMetadata, PagedKVCache
from rollout.scheduler import ScheduledBatch


class PagedAttention:
    """The model's attention backend during generation: write new K/V, attend over live blocks."""

    def __init__(self, cache: PagedKVCache, meta: AttentionMetadata, scale: float, impl):
        self.cache, self.meta, self.scale, self.impl = cache, meta, scale, impl

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.impl.write_kv(self.cache, layer, k, v, self.meta)
        return self.impl.paged_attention(q, self.cache, layer, self.meta, self.scale)


def attention_impl(device: torch.device):
    """Triton kernels on CUDA, the pure-torch reference elsewhere; both take the same arguments."""
    if device.type == "cuda":
        import kernels
        return kernels
    return torch_attention


class ModelRunner:
    """Owns the model and the KV cache; one ``run`` per engine step."""

    def __init__(self, model, num_blocks: int, block_size: int, device: torch.device, dtype: torch.dtype):
        cfg = model.config
        self.model = model
        self.device = device
        self.block_size = block_size
        self.cache = PagedKVCache.allocate(cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim,
                                           dtype, device)
        self.scale = 1.0 / math.sqrt(cfg.head_dim)
        self.impl = attention_impl(device)

    def prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Flatten the batch: input ids ``[N]``, positions ``[N]`` and the attention metadata."""
        bs = self.block_size
        ids, pos, slots, deaths, starts = [], [], [], [], [0]
        tables, indices = [], []
        for seq, n in zip(batch.seqs, batch.num_tokens):
            a = seq.num_computed
            ids.extend(seq.token_ids[a:a + n])
            pos.extend(range(a, a + n))
            slots.extend(seq.blocks[p // bs] * bs + p % bs for p in range(a, a + n))
            deaths.extend(seq.tracker.death[a:a + n])
            starts.append(starts[-1] + n)
            tables.append(list(seq.blocks.values()))
            indices.append(list(seq.blocks.keys()))
        width = max(len(t) for t in tables)
        pad = lambda rows: [r + [-1] * (width - len(r)) for r in rows]  # noqa: E731
        meta = AttentionMetadata(
            query_start=torch.tensor(starts, dtype=torch.int32),
            query_pos=torch.tensor(pos, dtype=torch.int32),
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            slot_death=torch.tensor(deaths, dtype=torch.int32),
            block_tables=torch.tensor(pad(tables), dtype=torch.int32),
            block_index=torch.tensor(pad(indices), dtype=torch.int32),
            num_live_blocks=torch.tensor([len(t) for t in tables], dtype=torch.int32),
            max_query_len=max(batch.num_tokens),
            max_live_blocks=width,
        )
        return torch.tensor(ids, dtype=torch.long), torch.tensor(pos, dtype=torch.long), meta

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch, sample_rows: list[int]) -> torch.Tensor:
        """Forward the batch; logits ``[len(sample_rows), V]`` (fp32) at the last token of those sequences."""
        ids, pos, meta = self.prepare(batch)
        dev = self.device
        meta = meta.to(dev)
        hidden = self.model(ids.to(dev), pos.to(dev), PagedAttention(self.cache, meta, self.scale, self.impl))
        last = meta.query_start[1:].long() - 1
        return self.model.compute_logits(hidden[last[sample_rows]])

    def set_death(self, slots: list[int], death: int) -> None:
        """Registers: keys at ``slots`` die at position ``death`` (their step was killed)."""
        self.cache.death.view(-1)[torch.tensor(slots, dtype=torch.long, device=self.device)] = death
