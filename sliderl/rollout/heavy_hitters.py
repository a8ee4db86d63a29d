"""Paged H2O (``h2o:B``): one sequence's accumulated attention mass per KV page, and which pages to evict.

Budget: B tokens in whole pages. A decode step that writes position ``a`` holds at most
``B // block_size`` pages: the ``R = max(1, (B // 2) // block_size)`` most recent logical pages (the
page being written, ``a // block_size``, and the R - 1 before it) are always kept, and the rest of the
budget holds the older pages with the highest accumulated mass (the heavy hitters). Every page is a
candidate once it is older than the recent pages, prompt pages included (TIP's PH2O treats all
tokens alike).

Mass: the attention probability a page's keys receive from each query of the sequence, summed over
query heads and layers (one block table serves every layer) and accumulated over engine steps.
Every query the engine computes contributes, prefill chunks included (``kernels.reference``; on CUDA
the decode kernel's ``OUTPUT_MASS``). Eviction waits until the whole prompt has been scored, so the
first decode step or two (with overlap) may hold the prompt's pages beyond the budget; the block
bound (``rollout.block_bound``) counts them.

Lag: the scheduler evicts when it allocates a decode step, with the mass read back so far: the
previous step's, or with overlap (``rollout.run_ahead``) the one before. An evicted page dies at the
position of the step whose block table first lacks it, the first query that does not see it, which
is what the trace records. Ties in mass go to the older page.
"""

from __future__ import annotations

import numpy as np


class HeavyHitters:
    """Mass per logical page of one sequence (a float64 array indexed by page, grown on demand; an evicted page's
    entry is zeroed, so a page a preempted sequence's recompute brings back starts afresh); ``victims`` picks
    the pages to evict."""

    def __init__(self, budget_pages: int, recent_pages: int, prompt_len: int):
        assert 1 <= recent_pages <= budget_pages, (recent_pages, budget_pages)
        self.budget_pages = budget_pages
        self.recent_pages = recent_pages
        self.prompt_len = prompt_len
        self.mass = np.zeros(64)
        self.scored_through = 0  # queries at positions below this have added their mass

    def add(self, pages: np.ndarray, values: np.ndarray, through: int) -> None:
        """Add one step's mass: ``values[c]`` for block-table column c, which held logical page ``pages[c]``
        (-1: padding) when the step was launched. ``through``: one past the step's last query position."""
        width = min(len(pages), len(values))
        pages, values = pages[:width], values[:width]
        held = pages >= 0
        pages = pages[held]
        if pages.size:
            self._grow(int(pages.max()))
            self.mass[pages] += values[held]  # a block table holds each page once: no repeated index
        self.scored_through = max(self.scored_through, through)

    def set_mass(self, pages: list[int], value: float) -> None:
        """Give ``pages`` the mass ``value`` (benchmarks that synthesise a long history)."""
        self._grow(max(pages))
        self.mass[pages] = value

    def _grow(self, page: int) -> None:
        if page >= len(self.mass):
            self.mass = np.concatenate([self.mass, np.zeros(max(page + 1, 2 * len(self.mass)) - len(self.mass))])

    def victims(self, live: list[int], writing: int) -> list[int]:
        """Logical pages to evict before the page ``writing`` is written (it may already be in ``live``),
        lowest mass first (ties: older first), so that at most ``budget_pages`` remain; none until the
        whole prompt has been scored."""
        held = set(live) | {writing}
        over = len(held) - self.budget_pages
        if over <= 0 or self.scored_through < self.prompt_len:
            return []
        candidates = np.array(sorted(j for j in held if j <= writing - self.recent_pages), dtype=np.int64)
        assert len(candidates) >= over, (sorted(held), writing, self.recent_pages, self.budget_pages)
        self._grow(writing)
        order = np.lexsort((candidates, self.mass[candidates]))  # by mass, then by page (older first)
        evicted = candidates[order[:over]]
        self.mass[evicted] = 0.0
        return sorted(evicted.tolist())
