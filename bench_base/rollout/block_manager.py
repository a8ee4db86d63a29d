"""Physical KV blocks: a free list with check-then-act allocation."""

from __future__ import annotations

from collections import deque


class BlockManager:
    """Hands out physical block ids of the paged KV pool and takes them back."""

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least 1 block, got num_blocks={num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._used = [False] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self) -> int:
        assert self._free, "allocate() without can_allocate()"
        block = self._free.popleft()
        assert not self._used[block]
        self._used[block] = True
        return block

    def free(self, block: int) -> None:
        assert self._used[block], f"block {block} freed twice"
        self._used[block] = False
        self._free.append(block)
