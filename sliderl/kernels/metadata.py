"""The attention-metadata interface between the engine and every paged-attention implementation.

The engine flattens a batch into N query tokens; sequence s owns query rows
``query_start[s] : query_start[s+1]``. Keys live in a paged cache of ``num_blocks`` blocks of
``block_size`` slots; slot ``b * block_size + j`` of physical block b holds the key at logical
position ``block_index * block_size + j`` of the sequence whose table lists b.

Visibility (see ``core.kv_policy``): a query at position q reads the key at position k when
``k <= q < death[slot]``. ``block_tables`` lists only *live* blocks (inter-tile skipping: a dead or
out-of-window block is never read); boundary blocks are masked slot by slot (intra-tile masking).
These positions are the tokens' places in the sequence's block table, which are their token
positions except for Pasta threads (``rollout.pasta.thread``): their tables interleave threads, a block
may sit at different logical indices in different threads' tables, and RoPE positions travel apart.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    """Per-step tensors; every implementation (torch reference, Triton) reads exactly these."""

    query_start: torch.Tensor  # [S+1] int32, cumulative query counts per sequence
    query_pos: torch.Tensor  # [N] int32, each query token's position in its table's order (the mask's q)
    slot_mapping: torch.Tensor  # [N] int64, cache slot that receives each query token's K/V
    slot_death: torch.Tensor  # [N] int32, death position written beside each new K/V
    block_tables: torch.Tensor  # [S, M] int32, physical ids of live blocks (any order), -1 pad
    block_index: torch.Tensor  # [S, M] int32, logical block index of each live block, -1 pad
    num_live_blocks: torch.Tensor  # [S] int32
    max_query_len: int
    max_live_blocks: int
    # [S, 2] int32 or None: decode only, keys at positions lo <= k < hi are dead for sequence s's query although the
    # cache's deaths do not say so yet (``register_kills``: a register its input token re-emits)
    kill: torch.Tensor | None = None
    scratch: dict = field(default_factory=dict, repr=False, compare=False)  # per-forward values a kernel derives
    # once and every layer reuses (the CPU decode's visibility); never moved by ``to``

    @property
    def num_seqs(self) -> int:
        return self.query_start.numel() - 1

    @property
    def is_decode(self) -> bool:
        """One query per sequence: the decode kernel applies."""
        return self.max_query_len == 1

    def to(self, device: torch.device | str) -> AttentionMetadata:
        moved = {k: (v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v)
                 for k, v in vars(self).items() if k != "scratch"}
        return AttentionMetadata(**moved)


def register_kills(input_ids: torch.Tensor, ranges: torch.Tensor, register_of: torch.Tensor,
                   query_pos: torch.Tensor) -> torch.Tensor:
    """``AttentionMetadata.kill`` of a registers decode step queued before its input tokens were read back: a query
    whose input token is ``<reg_i>`` must not see the step ``<reg_i>`` held (``core.kv_policy``: that step dies at
    the query's position), which the host learns, and writes into the cache's deaths, one step later.

    ``input_ids [S]``; ``ranges [S, N, 2]`` int32, each sequence's ``DeathTracker.register_ranges`` as the host last
    knew them (a growing step's end NEVER: it ends at the query); ``register_of [V]`` int32, a token's register index
    or -1; ``query_pos [S]``. Returns ``[S, 2]`` int32 (lo, hi), (0, 0) for no kill. A step whose input token the
    host has already followed gets an empty range: the register's new step starts at the query itself.
    Device-side tensor ops only, so a captured decode graph computes it at every replay."""
    reg = register_of[input_ids]  # [S]
    held = ranges.gather(1, reg.clamp(min=0).long()[:, None, None].expand(-1, 1, 2))[:, 0]  # [S, 2]
    hit = reg >= 0
    lo = torch.where(hit, held[:, 0], 0)
    hi = torch.where(hit, torch.minimum(held[:, 1], query_pos), 0)
    return torch.stack([lo, hi], 1).to(torch.int32)


@dataclass
class PagedKVCache:
    """K/V pools for every layer plus the per-slot death positions shared by all layers."""

    k: list[torch.Tensor]  # per layer [num_blocks, block_size, H_kv, D]
    v: list[torch.Tensor]  # per layer [num_blocks, block_size, H_kv, D]
    death: torch.Tensor  # [num_blocks, block_size] int32

    @classmethod
    def allocate(cls, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str) -> PagedKVCache:
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        death = torch.zeros((num_blocks, block_size), dtype=torch.int32, device=device)
        return cls(k, v, death)

    @property
    def block_size(self) -> int:
        return self.death.shape[1]

    @property
    def num_blocks(self) -> int:
        return self.death.shape[0]

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * block_size * num_kv_heads * head_dim * elem + block_size * 4
