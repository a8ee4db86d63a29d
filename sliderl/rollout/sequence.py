"""One request's state inside the engine, and the record it turns into when it finishes."""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, field
from enum import Enum, auto

import numpy as np

from sliderl.core.kv_policy import DeathTracker
from sliderl.rollout.block_bound import block_bound
from sliderl.rollout.heavy_hitters import HeavyHitters
from sliderl.rollout.sampling import SamplingParams


class Status(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


@dataclass
class KVUsage:
    """KV use of one completion: keys visible to the queries that produced it, blocks held."""

    peak_visible_tokens: int = 0
    mean_visible_tokens: float = 0.0
    peak_blocks: int = 0
    token_steps: int = 0  # KV-token-steps: the sum over generated tokens of the keys their query saw


@dataclass
class RequestOutput:
    """A finished request. ``logprobs[i]`` is the sampler's log-probability of ``token_ids[i]``.

    A decoding mode may return a subclass with its own record (``rollout.mode``; Pasta's carries its threads).
    """

    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str  # "stop" (eos, stop token or string) | "length" (max_tokens or max_model_len)
    kv: KVUsage
    forced: list[bool] = field(default_factory=list)  # True where budget forcing inserted the token
    num_preemptions: int = 0
    seconds: float = 0.0
    kv_deaths: list[tuple[int, int, int]] = field(default_factory=list)  # h2o: evicted (start, end, death) ranges
    token_seconds: list[float] = field(default_factory=list)  # when each token was taken, seconds after arrival

    @property
    def max_token_seconds(self) -> float:
        """The longest wait for one token after the first (per-token latency's worst case: a restart's spike)."""
        times = self.token_seconds
        return max((b - a for a, b in zip(times, times[1:])), default=0.0)


class Sequence:
    """Tokens, KV blocks and visibility of one request.

    ``num_computed`` tokens have their K/V in the cache; the next query position is ``num_computed``.
    ``blocks`` maps logical block index -> physical block for live blocks only. ``block_table`` /
    ``block_index`` mirror it as arrays (first ``len(blocks)`` entries, in no particular order:
    attention masks by position, so a freed block is swap-removed in O(1)).

    ``block_bound`` is the most blocks it can ever hold (``rollout.block_bound``), from its policy,
    prompt length and ``max_tokens``, capped by ``max_model_len``; ``max_chunk`` is the longest
    prefill chunk (``max_num_batched_tokens``). Admission reserves it under a bounded policy.

    Under h2o, ``heavy`` holds the pages' attention mass (``rollout.heavy_hitters``) and ``kv_deaths``
    the evicted pages as ``(start, end, death)`` ranges, in eviction order.
    """

    def __init__(self, request_id: int, prompt_token_ids: list[int], params: SamplingParams, seed: int,
                 tracker: DeathTracker, block_size: int, arrival: float, *, max_model_len: int, max_chunk: int):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.token_ids = list(prompt_token_ids)
        self.params = params
        self.seed = seed
        self.tracker = tracker
        self.block_size = block_size
        self.arrival = arrival
        self.status = Status.WAITING
        self.num_computed = 0
        self.blocks: dict[int, int] = {}
        self.block_table = np.full(16, -1, dtype=np.int32)
        self.block_index = np.full(16, -1, dtype=np.int32)
        self._column: dict[int, int] = {}  # logical block -> its column in the arrays
        self._free_heap: list[tuple[int, int]] = []  # (max death, logical block) of complete blocks
        self.logprobs: list[float] = []
        self.forced: list[bool] = []
        self.token_times: list[float] = []  # perf_counter when each generated token was taken
        self.pending_forced: list[int] = []
        self.thinking_done = False
        self.finish_reason: str | None = None
        self.finished_at = 0.0
        self.num_preemptions = 0
        self.visible_sum = 0
        self.kv = KVUsage()
        policy = tracker.policy
        self.heavy = HeavyHitters(*policy.budget_pages(block_size), self.prompt_len) if policy.kind == "h2o" else None
        self.kv_deaths: list[tuple[int, int, int]] = []
        self.block_bound = block_bound(tracker.policy, self.prompt_len, params.max_tokens, max_model_len, block_size,
                                       max_chunk)
        for pos, tok in enumerate(self.prompt_token_ids):
            tracker.append(pos, tok)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len:]

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed

    @property
    def may_be_forced(self) -> bool:
        """Budget forcing may replace the token sampled next (a forced token is due, or thinking is capped)."""
        return bool(self.pending_forced) or (self.params.max_thinking_tokens is not None and not self.thinking_done)

    def key_deaths(self, start: int, n: int) -> list[int]:
        """Deaths of positions ``start .. start + n - 1`` as known now.

        A position whose token is not appended yet (a decode step queued before its token was read
        back) gets the death its position alone gives; a later register kill reaches the cache apart.
        """
        known = self.tracker.death[start:start + n]
        return known + [self.tracker.initial_death(p) for p in range(start + len(known), start + n)]

    def mark_computed(self, n: int) -> None:
        """The next ``n`` tokens now have their K/V in the cache; blocks they complete may be freed later."""
        before, self.num_computed = self.num_computed, self.num_computed + n
        for j in range(before // self.block_size, self.num_computed // self.block_size):
            self.block_completed(j)

    # ---- where tokens go: what the scheduler and the model runner ask (a mode's sequences override) ----
    def table_positions(self, start: int, n: int) -> range:
        """Slots of tokens ``start .. start + n - 1`` in the block table's order (logical block · block_size +
        offset): the positions attention masks with. A sequence writes its tokens in order."""
        return range(start, start + n)

    def rope_positions(self, start: int, n: int) -> range:
        """RoPE position ids of tokens ``start .. start + n - 1`` (the token index here)."""
        return range(start, start + n)

    @property
    def last_position(self) -> int:
        """RoPE position of the last token (``max_model_len`` caps it)."""
        return len(self.token_ids) - 1

    def ready_tokens(self, batch) -> int:
        """How many of the uncomputed tokens may be computed in ``batch``, the ``ScheduledBatch`` being built
        (all of them here)."""
        return self.num_uncomputed

    @property
    def samples_on(self) -> bool:
        """Whether the token it samples in a step is appended, so that a queued step may compute it: always
        here (a token that finishes the request is dropped with its queued row); not for a stopped Pasta thread."""
        return True

    @property
    def may_run_ahead(self) -> bool:
        """Whether its next decode row may be queued before its last token is read back (``rollout.run_ahead``):
        always here; a Pasta request's threads may not while a change to them is not yet scheduled."""
        return True

    def stale_ahead(self) -> bool:
        """Whether the decode row queued for it before its last token was read back no longer fits what that token
        did (a Pasta main thread's joining ``<sync/>`` moves in its table): the row is then dropped."""
        return False

    def fit(self, n: int, free_blocks: int) -> int:
        """The most of the next ``n`` tokens whose new blocks number at most ``free_blocks``."""
        bs = self.block_size
        first = self.num_computed // bs
        room = (first + 1) * bs - self.num_computed if first in self.blocks else 0
        return min(n, room + free_blocks * bs)

    def new_columns(self, n: int) -> list[int]:
        """Logical blocks the next ``n`` tokens need that are not held yet."""
        first, last = self.num_computed // self.block_size, (self.num_computed + n - 1) // self.block_size
        return [j for j in range(first, last + 1) if j not in self.blocks]

    def take_dead_slots(self) -> list[int]:
        """Physical slots whose keys must read as dead before the next forward (Pasta threads' left-over slots)."""
        return []

    @property
    def held_blocks(self) -> int:
        """Blocks this request holds (its peak is ``kv.peak_blocks``)."""
        return len(self.blocks)

    @property
    def thread_index(self) -> int:
        """Which thread of its request this sequence is (``LLM.force``): 0, the request itself."""
        return 0

    @property
    def tokens_taken(self) -> int:
        """Tokens it has taken in place of samples so far (a forcing script's cursor): its output."""
        return self.num_output

    @property
    def main(self) -> Sequence:
        """The sequence that stands for the request: itself (a Pasta fork's is its main thread)."""
        return self

    def threads(self) -> list[Sequence]:
        """The request's sequences in the order a step schedules them: itself."""
        return [self]

    def add_block(self, j: int, block: int) -> None:
        col = len(self.blocks)
        if col == len(self.block_table):
            self.block_table = np.concatenate([self.block_table, np.full(col, -1, dtype=np.int32)])
            self.block_index = np.concatenate([self.block_index, np.full(col, -1, dtype=np.int32)])
        self.blocks[j] = block
        self._column[j] = col
        self.block_table[col], self.block_index[col] = block, j

    def remove_block(self, j: int) -> int:
        block, col, last = self.blocks.pop(j), self._column.pop(j), len(self.blocks)
        if col != last:  # move the last column into the hole
            moved = int(self.block_index[last])
            self.block_table[col], self.block_index[col] = self.block_table[last], moved
            self._column[moved] = col
        self.block_table[last] = self.block_index[last] = -1
        return block

    def append_token(self, token: int, logprob: float, forced: bool) -> list[tuple[int, int]]:
        """Record a sampled (or forced) token; returns position ranges its arrival killed."""
        self.visible_sum += self.tracker.visible
        self.kv.peak_visible_tokens = max(self.kv.peak_visible_tokens, self.tracker.visible)
        pos = len(self.token_ids)
        self.token_ids.append(token)
        self.logprobs.append(logprob)
        self.forced.append(forced)
        self.token_times.append(time.perf_counter())
        return self.tracker.append(pos, token)

    def block_completed(self, j: int) -> None:
        """Block j now holds all its positions: it becomes a candidate for freeing."""
        self.push_free_candidate(j)

    def push_free_candidate(self, j: int) -> None:
        bs = self.block_size
        heapq.heappush(self._free_heap, (max(self.tracker.death[j * bs:(j + 1) * bs]), j))

    def pop_dead_blocks(self) -> list[int]:
        """Physical blocks no future query (position >= num_computed) can see; removes them."""
        dead = []
        while self._free_heap and self._free_heap[0][0] <= self.num_computed:
            _, j = heapq.heappop(self._free_heap)
            bs = self.block_size
            if j in self.blocks and max(self.tracker.death[j * bs:(j + 1) * bs]) <= self.num_computed:
                dead.append(self.remove_block(j))
        return dead

    def evict_heavy_hitters(self) -> list[int]:
        """h2o, before the decode step that writes position ``num_computed``: drop the pages the budget
        cannot keep (their keys die at that position); returns their physical ids."""
        a, bs = self.num_computed, self.block_size
        freed = []
        for j in self.heavy.victims(list(self.blocks), a // bs):
            freed.append(self.remove_block(j))
            self.tracker.evict(j * bs, (j + 1) * bs, a)
            self.kv_deaths.append((j * bs, (j + 1) * bs, a))
        return freed

    def release_blocks(self) -> list[int]:
        """Drop every block (finish or preemption); returns the physical ids to free."""
        freed = list(self.blocks.values())
        for j in list(self.blocks):
            self.remove_block(j)
        self._free_heap.clear()
        return freed

    def reset_for_recompute(self) -> list[int]:
        """Preemption: drop every block; the tokens stay and are prefilled again later."""
        self.num_computed = 0
        self.num_preemptions += 1
        self.status = Status.WAITING
        return self.release_blocks()
