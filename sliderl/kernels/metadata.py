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
