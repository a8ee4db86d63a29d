"""Turns a scheduled batch into tensors, runs the model over the paged cache, samples from the logits.

On CUDA, decode steps replay CUDA graphs captured per batch-size bucket; prefill runs eagerly. Under
h2o (``track_mass``) every forward also returns its attention mass per block-table column
(``PageMass``): a replayed decode step writes it into the graphs' static buffer, copied out after the replay.
Host work per step is proportional to the batch and its live blocks, never to sequence length.
Nothing here waits for the device: tensors cross to it from pinned memory, results stay on it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from sliderl.core.logprob import logprobs_at
from sliderl.kernels.metadata import AttentionMetadata, PagedKVCache, register_kills
from sliderl.rollout.decode_graphs import DecodeGraphs
from sliderl.rollout.forcing import ForcedTokens
from sliderl.rollout.paged_attention import PagedAttention, attention_impl
from sliderl.rollout.sampling import greedy_sample, sample
from sliderl.rollout.scheduler import ScheduledBatch
from sliderl.rollout.sequence import Sequence


@dataclass
class PageMass:
    """One forward's attention mass (h2o): row i is the batch's row i, column c its block-table column c."""

    values: torch.Tensor  # [S, M] float32 on the device, summed over layers, query heads and the row's queries
    pages: np.ndarray  # [S, M] int32, the logical page each column held at launch, -1 pad
    ends: list[int]  # [S] one past each row's last query position

    def take(self, rows: list[int], index: torch.Tensor) -> PageMass:
        """The mass of ``rows`` only (``index``: the same rows on the device)."""
        return PageMass(self.values[index], self.pages[rows], [self.ends[i] for i in rows])


class ModelRunner:
    """Owns the model and the KV cache; one ``run`` per engine step.

    The last block of the pool is a scratch block no sequence owns: padded rows of a captured
    decode graph write their K/V there.
    """

    def __init__(self, model, num_blocks: int, block_size: int, device: torch.device, dtype: torch.dtype,
                 max_num_seqs: int, max_model_len: int, cuda_graphs: bool = True, track_mass: bool = False,
                 gemv: bool = False, pdl: bool = False, register_ids: list[int] | None = None):
        cfg = model.config
        self.track_mass = track_mass
        # registers: each token's register index (-1: none), for the pending kills of a decode step queued before its
        # input tokens were read back (kernels.metadata.register_kills)
        self.register_of = None
        if register_ids:
            table = torch.full((max(cfg.vocab_size, max(register_ids) + 1),), -1, dtype=torch.int32)
            table[torch.tensor(register_ids)] = torch.arange(len(register_ids), dtype=torch.int32)
            self.register_of = table.to(device)
        self.num_registers = len(register_ids or ())
        self.model = model
        model.fused_kernels = device.type == "cuda"  # Triton norms, q-k-norm + RoPE; fused q/k/v and gate/up
        model.gemv_kernels = device.type == "cuda" and gemv  # small-batch linears on kernels.gemv
        from sliderl.kernels.pdl import check_pdl
        model.pdl_kernels = check_pdl(pdl, device)  # the fused path's Triton kernels as one PDL chain (Hopper)
        self.device = device
        self.block_size = block_size
        self.num_blocks, self.dtype = num_blocks, dtype
        self.scratch_slot = num_blocks * block_size
        self.scale = 1.0 / math.sqrt(cfg.head_dim)
        self.impl = attention_impl(device)
        self.use_graphs = device.type == "cuda" and cuda_graphs
        self.max_num_seqs, self.max_blocks = max_num_seqs, math.ceil(max_model_len / block_size) + 1
        self.cache, self.graphs = None, None
        self.mode_graphs: list = []  # a decoding mode's own graphs over the pool (PD's SpanGraphs): .close() on release
        self.forced = ForcedTokens()  # teacher forcing (``LLM.force``)
        self.allocate()

    def allocate(self) -> None:
        """Allocate the KV pool (``num_blocks`` + the scratch block, zeroed) and capture the decode graphs over it."""
        assert self.cache is None, "the KV pool is already allocated"
        cfg = self.model.config
        self.cache = PagedKVCache.allocate(cfg.num_layers, self.num_blocks + 1, self.block_size, cfg.num_kv_heads,
                                           cfg.head_dim, self.dtype, self.device)
        if self.use_graphs:
            self.graphs = DecodeGraphs(self, self.max_num_seqs, self.max_blocks)

    def release(self) -> None:
        """Drop the CUDA graphs and the KV pool, keeping the model; ``allocate`` builds them again (the graphs
        point into the pool, so they go with it; a mode's graphs are captured again on their next use)."""
        if self.graphs is not None:
            self.graphs.close()
        for graphs in self.mode_graphs:
            graphs.close()
        self.graphs = self.cache = None

    def prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, AttentionMetadata, torch.Tensor | None]:
        """Flatten the batch on the host: RoPE positions ``[N]``, the attention metadata and, under registers for a
        decode step, each sequence's ``DeathTracker.register_ranges`` as one ``[S, N, 2]`` tensor (else None).

        A new key's death is the one known now (``Sequence.key_deaths``); a register kill that comes
        later reaches the cache through ``set_death``. The mask's query positions are the tokens' slots in
        their block table's order (``Sequence.table_positions``), RoPE's are ``Sequence.rope_positions``: the
        same numbers except for Pasta threads, whose tables interleave threads (``rollout.pasta.runtime``).
        """
        bs = self.block_size
        pos, table_pos, slots, deaths, starts = [], [], [], [], [0]
        for seq, n in zip(batch.seqs, batch.num_tokens):
            a = seq.num_computed
            at = seq.table_positions(a, n)
            pos.extend(seq.rope_positions(a, n))
            table_pos.extend(at)
            slots.extend(seq.blocks[p // bs] * bs + p % bs for p in at)
            deaths.extend(seq.key_deaths(a, n))
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
            query_pos=host(table_pos, torch.int32),
            slot_mapping=host(slots, torch.int64),
            slot_death=host(deaths, torch.int32),
            block_tables=host(tables),
            block_index=host(indices),
            num_live_blocks=host(live, torch.int32),
            max_query_len=max(batch.num_tokens),
            max_live_blocks=width,
        )
        ranges = None
        if self.register_of is not None and meta.is_decode:
            ranges = host(np.stack([seq.tracker.register_ranges for seq in batch.seqs]))
        return host(pos, torch.long), meta, ranges

    def host_tensor(self, values, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A CPU tensor of ``values`` (list or numpy array), in pinned memory when the model is on CUDA.

        A copy from pageable memory makes the host wait for the GPU to drain its stream; from pinned
        memory it is queued like a kernel, which is what lets the engine run ahead of the GPU.
        """
        t = torch.from_numpy(values) if isinstance(values, np.ndarray) else torch.tensor(values, dtype=dtype)
        return t.pin_memory() if self.device.type == "cuda" else t

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch, sample_rows: list[int],
            input_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, PageMass | None]:
        """Forward the batch; logits ``[len(sample_rows), V]`` (fp32) at the last token of those sequences,
        and under ``track_mass`` the forward's ``PageMass`` (else None).

        ``input_ids``: the batch's input tokens already on the device (a decode step queued before
        they were read back); by default they are read from the sequences.
        """
        pos, meta, ranges = self.prepare(batch)
        ids = input_ids if input_ids is not None else self.host_tensor(batch.input_ids(), torch.long)
        dead = batch.dead_slots()
        if dead:  # slots a Pasta thread left empty: no query may read them (written before the step's K/V)
            self.set_death(dead, 0)
        mass = None
        ends = [s.num_computed + n for s, n in zip(batch.seqs, batch.num_tokens)] if self.track_mass else None
        if self.graphs is not None and meta.is_decode and self.graphs.fits(meta):
            hidden, values = self.graphs.run(ids, pos, meta, ranges)
            if values is not None:
                mass = PageMass(values, meta.block_index.numpy(), ends)
        else:
            dev = self.device
            if self.track_mass:
                mass = PageMass(torch.zeros(meta.block_index.shape, dtype=torch.float32, device=dev),
                                meta.block_index.numpy(), ends)
            meta = meta.to(dev)
            ids = ids.to(dev, non_blocking=True)
            if ranges is not None and input_ids is not None:  # a queued step: an input register's kill is pending
                meta.kill = register_kills(ids, ranges.to(dev, non_blocking=True), self.register_of, meta.query_pos)
            attn = PagedAttention(self.cache, meta, self.scale, self.impl, mass=mass.values if mass is not None else None)
            hidden = self.model(ids, pos.to(dev, non_blocking=True), attn)
            hidden = hidden[meta.query_start[1:].long() - 1]
        if len(sample_rows) == hidden.shape[0] and all(r == i for i, r in enumerate(sample_rows)):
            return self.model.compute_logits(hidden), mass  # every row, in order (a decode step): no gather
        rows = self.host_tensor(sample_rows, torch.long).to(hidden.device, non_blocking=True)
        return self.model.compute_logits(hidden[rows]), mass

    def sample(self, seqs: list[Sequence], logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens and logprobs of ``seqs`` (rows of ``logits``), left on the device; rows with a forced token
        (``LLM.force``) take it, with its logprob under the sampler's convention."""
        dev = logits.device
        if not seqs:
            return torch.empty(0, dtype=torch.long, device=dev), torch.empty(0, device=dev)
        col = lambda values, dtype: self.host_tensor(values, dtype).to(dev, non_blocking=True)  # noqa: E731
        params = [s.params for s in seqs]
        rows, forced = self.forced.due(seqs)
        all_greedy = all(p.temperature <= 0 for p in params)
        if all_greedy and not rows:  # no row's parameters are needed: nothing to copy over
            return greedy_sample(logits)
        # the rows' parameters in two host-to-device copies, not five (each copy costs the host ~30 us per step)
        temperature, top_p = col([[p.temperature for p in params], [p.top_p for p in params]], torch.float32)
        if len(rows) == len(seqs):  # every row forced: nothing to draw
            tokens = col(forced, torch.long)
            return tokens, logprobs_at(logits, tokens, temperature)
        top_k, seed, step = col([[p.top_k for p in params], [s.seed for s in seqs], [s.num_output for s in seqs]],
                                torch.int64)
        tokens, logprobs = sample(logits, temperature, top_p, top_k, seed, step, all_greedy=all_greedy,
                                  any_truncation=any(p.top_k > 0 or p.top_p < 1 for p in params))
        if rows:
            index, chosen = col(rows, torch.long), col(forced, torch.long)
            tokens = tokens.index_copy(0, index, chosen)
            logprobs = logprobs.index_copy(0, index, logprobs_at(logits[index], chosen, temperature[index]))
        return tokens, logprobs

    def close(self) -> None:
        """Drop the CUDA graphs, the KV cache and the model: their device memory is freed once the engine
        drops this runner too (nothing here needs a garbage collection)."""
        self.release()
        self.mode_graphs.clear()  # they point back at this runner
        self.model = None

    def set_death(self, slots: list[int], death: int) -> None:
        """Keys at ``slots`` die at position ``death`` (registers: their step was killed; pasta: 0, for slots a
        thread left empty)."""
        index = self.host_tensor(slots, torch.long).to(self.device, non_blocking=True)
        # index_fill_ takes the scalar as such; `death[index] = death` copied a 0-d CPU tensor to the
        # device, which made the host wait for the queued step at every kill (engine_gpu --sync-debug)
        self.cache.death.view(-1).index_fill_(0, index, death)
