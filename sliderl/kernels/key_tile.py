"""Device pieces shared by the attention kernels: one tile of a sequence's live keys, softmax constants.

A sequence's live keys are its live blocks laid end to end: live key i sits in live block
``i // block_size`` (``block_tables[s, i // block_size]``) at slot ``i % block_size``. A tile is
``TILE_N`` consecutive live keys, so it spans several small blocks or part of one large block.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634  # softmax runs in base 2: exp(x * scale) = exp2(x * scale * LOG2E)
EMPTY_MAX = tl.constexpr(-1.0e30)  # running max before any visible key: finite, so exp2 never sees (-inf) - (-inf)


@triton.jit
def key_tile_slots(block_table_row, num_live, tile, stride_block, stride_slot,
                   BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr):
    """Where a tile's keys live, from the block table alone: slot offsets (int64, into a K/V pool without the
    head offset), pool blocks, slots within them, in-range flags, all ``[TILE_N]``."""
    key = tile * TILE_N + tl.arange(0, TILE_N)
    live_block = key // BLOCK_SIZE
    slot = key % BLOCK_SIZE
    in_range = live_block < num_live
    block = tl.load(block_table_row + live_block, mask=in_range, other=0).to(tl.int64)
    offset = block * stride_block + slot.to(tl.int64) * stride_slot
    return offset, block, slot, in_range


@triton.jit
def live_key_tile(block_table_row, block_index_row, death_ptr, num_live, tile,
                  stride_block, stride_slot,
                  BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr):
    """``key_tile_slots``' offsets, then positions and deaths: ``(offset, pos, death, in_range)``, all ``[TILE_N]``."""
    offset, block, slot, in_range = key_tile_slots(block_table_row, num_live, tile, stride_block, stride_slot,
                                                   BLOCK_SIZE, TILE_N)
    live_block = (tile * TILE_N + tl.arange(0, TILE_N)) // BLOCK_SIZE
    logical = tl.load(block_index_row + live_block, mask=in_range, other=0)
    pos = logical * BLOCK_SIZE + slot
    death = tl.load(death_ptr + block * BLOCK_SIZE + slot, mask=in_range, other=0)
    return offset, pos, death, in_range

