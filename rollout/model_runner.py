"""Turns a scheduled batch into tensors, runs the model over the paged cache, returns logits.

On CUDA, decode steps replay CUDA graphs captured per batch-size bucket; prefill runs eagerly.
Host work per step is proportional to the batch and its live blocks, never to sequence length.
"""

from __future__ import annotations

import math

import numpy as np
import torch

import kernels.reference as torch_attention
from kernels.metadata import AttentionMetadata, PagedKVCache
from rollout.decode_graphs import DecodeGraphs
from rollout.scheduler import ScheduledBatch


class PagedAttention:
    """The model's attention backend during generation: write new K/V, attend over live blocks."""

    def __init__(self, cache: PagedKVCache, meta: AttentionMetadata, scale: float, impl, decode_config=None):
        self.cache, self.meta, self.scale, self.impl, self.decode_config = cache, meta, scale, impl, decode_config

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.impl.write_kv(self.cache, layer, k, v, self.meta)
        if self.decode_config is not None:
            from kernels.decode import decode_attention
            return decode_attention(q, self.cache, layer, self.meta, self.scale, config=self.decode_config)
        return self.impl.paged_attention(q, self.cache, layer, self.meta, self.scale)


def attention_impl(device: torch.device):
    """Triton kernels on CUDA, the pure-torch reference elsewhere; both take the same arguments."""
    if device.type == "cuda":
        import kernels
        return kernels
    return torch_attention


class ModelRunner:
    """Owns the model and the KV cache; one ``run`` per engine step.

    The last block of the pool is a scratch block no sequence owns: padded rows of a captured
    decode graph write their K/V there.
    """

    def __init__(self, model, num_blocks: int, block_size: int, device: torch.device, dtype: torch.dtype,
                 max_num_seqs: int, max_model_len: int, cuda_graphs: bool = True):
        cfg = model.config
        self.model = model
        self.device = device
        self.block_size = block_size
        self.cache = PagedKVCache.allocate(cfg.num_layers, num_blocks + 1, block_size, cfg.num_kv_heads,
                                           cfg.head_dim, dtype, device)
        self.scratch_slot = num_blocks * block_size
        self.scale = 1.0 / math.sqrt(cfg.head_dim)
        self.impl = attention_impl(device)
        self.graphs = None
        if device.type == "cuda" and cuda_graphs:
            max_blocks = math.ceil(max_model_len / block_size) + 1
            self.graphs = DecodeGraphs(self, max_num_seqs, max_blocks)

    def prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Flatten the batch on the host: input ids ``[N]``, positions ``[N]`` and the attention metadata."""
        bs = self.block_size
        ids, pos, slots, deaths, starts = [], [], [], [], [0]
        for seq, n in zip(batch.seqs, batch.num_tokens):
            a = seq.num_computed
            ids.extend(seq.token_ids[a:a + n])
            pos.extend(range(a, a + n))
            slots.extend(seq.blocks[p // bs] * bs + p % bs for p in range(a, a + n))
            deaths.extend(seq.tracker.death[a:a + n])
            starts.append(starts[-1] + n)
        live = [len(seq.blocks) for seq in batch.seqs]
        width = max(live)
        tables = np.full((len(live), width), -1, dtype=np.int32)
        indices = np.full((len(live), width), -1, dtype=np.int32)
        for i, (seq, m) in enumerate(zip(batch.seqs, live)):
            tables[i, :m] = seq.block_table[:m]
            indices[i, :m] = seq.block_index[:m]
        meta = AttentionMetadata(
            query_start=torch.tensor(starts, dtype=torch.int32),
            query_pos=torch.tensor(pos, dtype=torch.int32),
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            slot_death=torch.tensor(deaths, dtype=torch.int32),
            block_tables=torch.from_numpy(tables),
            block_index=torch.from_numpy(indices),
            num_live_blocks=torch.tensor(live, dtype=torch.int32),
            max_query_len=max(batch.num_tokens),
            max_live_blocks=width,
        )
        return torch.tensor(ids, dtype=torch.long), torch.tensor(pos, dtype=torch.long), meta

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch, sample_rows: list[int]) -> torch.Tensor:
        """Forward the batch; logits ``[len(sample_rows), V]`` (fp32) at the last token of those sequences."""
        ids, pos, meta = self.prepare(batch)
        if self.graphs is not None and meta.is_decode and self.graphs.fits(meta):
            hidden = self.graphs.run(ids, pos, meta)
        else:
            dev = self.device
            meta = meta.to(dev)
            attn = PagedAttention(self.cache, meta, self.scale, self.impl)
            hidden = self.model(ids.to(dev, non_blocking=True), pos.to(dev, non_blocking=True), attn)
            hidden = hidden[meta.query_start[1:].long() - 1]
        rows = torch.tensor(sample_rows, dtype=torch.long).to(hidden.device, non_blocking=True)
        return self.model.compute_logits(hidden[rows])

    def set_death(self, slots: list[int], death: int) -> None:
        """Registers: keys at ``slots`` die at position ``death`` (their step was killed)."""
        self.cache.death.view(-1)[torch.tensor(slots, dtype=torch.long, device=self.device)] = death
