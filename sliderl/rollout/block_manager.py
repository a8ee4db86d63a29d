"""Physical KV blocks: a free list with check-then-act allocation and reference counts."""

from __future__ import annotations

from collections import deque


class BlockManager:
    """Hands out physical block ids of the paged KV pool and takes them back.

    A block may be held by several sequences (Pasta threads share their request's blocks): ``share``
    adds a holder, ``free`` drops one, and the block returns to the pool when its last holder lets go.
    """

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least 1 block, got num_blocks={num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._refs = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self) -> int:
        assert self._free, "allocate() without can_allocate()"
        block = self._free.popleft()
        assert self._refs[block] == 0
        self._refs[block] = 1
        return block

    def share(self, block: int) -> None:
        """One more holder of an allocated block."""
        assert self._refs[block] > 0, f"block {block} shared while free"
        self._refs[block] += 1

    def free(self, block: int) -> None:
        """One holder lets go of ``block``; the last one returns it to the pool."""
        assert self._refs[block] > 0, f"block {block} freed twice"
        self._refs[block] -= 1
        if self._refs[block] == 0:
            self._free.append(block)

    def ref_count(self, block: int) -> int:
        return self._refs[block]
