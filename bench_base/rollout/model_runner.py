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
        model.fused_kernels = device.type == "cuda"  # Triton norm / q-k-norm + RoPE (kernels.norm_rope)
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

    def prepare(self, batch: ScheduledBatch, ahead: bool = False) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Flatten the batch on the host: input ids ``[N]``, positions ``[N]`` and the attention metadata.

        ``ahead``: a decode step queued before its input tokens are known (one token per sequence at
        ``num_computed == len(token_ids)``): ids are placeholders and each new key's death comes
        from its position alone (a register kill is applied later, by ``set_death``).
        """
        bs = self.block_size
        ids, pos, slots, deaths, starts = [], [], [], [], [0]
        for seq, n in zip(batch.seqs, batch.num_tokens):
            a = seq.num_computed
            ids.extend(seq.token_ids[a:a + n] if not ahead else [0])
            pos.extend(range(a, a + n))
            slots.extend(seq.blocks[p // bs] * bs + p % bs for p in range(a, a + n))
            deaths.extend(seq.tracker.death[a:a + n] if not ahead else [seq.tracker.initial_death(a)])
            starts.append(starts[-1] + n)
        live = [len(seq.blocks) for seq in batch.seqs]
        width = max(live)
        tables = np.full((len(live), width), -1, dtype=np.int32)
        indices = np.full((len(live), width), -1, dtype=np.int32)
        for i, (seq, m) in enumerate(zip(batch.seqs, live)):
            tables[i, :m] = seq.block_table[:m]
            indices[i, :m] = seq.block_index[:m]
        host = self.host_tensor
        meta = AttentionMetadata(
            query_start=host(starts, torch.int32),
            query_pos=host(pos, torch.int32),
            slot_mapping=host(slots, torch.int64),
            slot_death=host(deaths, torch.int32),
            block_tables=host(tables),
            block_index=host(indices),
            num_live_blocks=host(live, torch.int32),
            max_query_len=max(batch.num_tokens),
            max_live_blocks=width,
        )
        return host(ids, torch.long), host(pos, torch.long), meta

    def host_tensor(self, values, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A CPU tensor of ``values`` (list or numpy array), in pinned memory when the model is on CUDA.

        A copy from pageable memory makes the host wait for the GPU to drain its stream; from pinned
        memory it is queued like a kernel, which is what lets the engine run ahead of the GPU.
        """
        t = torch.from_numpy(values) if isinstance(values, np.ndarray) else torch.tensor(values, dtype=dtype)
        return t.pin_memory() if self.device.type == "cuda" else t

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch, sample_rows: list[int], input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Forward the batch; logits ``[len(sample_rows), V]`` (fp32) at the last token of those sequences.

        Nothing waits for the device. ``input_ids`` (on the device, one per sequence): the batch is a
        decode step queued ahead of its tokens (see ``prepare``), which are read from here on the GPU.
        """
        ids, pos, meta = self.prepare(batch, ahead=input_ids is not None)
        if input_ids is not None:
            ids = input_ids
        if self.graphs is not None and meta.is_decode and self.graphs.fits(meta):
            hidden = self.graphs.run(ids, pos, meta)
        else:
            dev = self.device
            meta = meta.to(dev)
            attn = PagedAttention(self.cache, meta, self.scale, self.impl)
            hidden = self.model(ids.to(dev, non_blocking=True), pos.to(dev, non_blocking=True), attn)
            hidden = hidden[meta.query_start[1:].long() - 1]
        rows = self.host_tensor(sample_rows, torch.long).to(hidden.device, non_blocking=True)
        return self.model.compute_logits(hidden[rows])

    def set_death(self, slots: list[int], death: int) -> None:
        """Registers: keys at ``slots`` die at position ``death`` (their step was killed)."""
        index = self.host_tensor(slots, torch.long).to(self.device, non_blocking=True)
        self.cache.death.view(-1)[index] = death
