"""The most KV blocks one sequence can hold at once: what the scheduler reserves when it admits it.

How a sequence holds blocks (``rollout.scheduler``, ``rollout.sequence``): a step writes the K/V of
a chunk ``[a, b)`` of its positions. Just before, at ``num_computed = a``, every *complete* block
whose keys no query ``>= a`` sees was freed (``Sequence.pop_dead_blocks``: after each step, and in
``Scheduler.schedule_ahead`` before a queued step allocates). So while ``[a, b)`` is written the
sequence holds exactly the blocks ``j <= (b - 1) // B`` that hold a position that never dies
(``j * B < keep``) or a key that query ``a`` still sees (``(j + 1) * B - 1 >= a - W + 1``, that is
``j >= (a - W + 1) // B``); the block being filled is one of the latter.

Under h2o the budget bounds every decode step once the prompt has been scored: at most ``B // block_size``
pages (``rollout.heavy_hitters``); before that the prefill holds the prompt's pages, and the first decode
step (its eviction waits for the prefill's mass) holds them plus the page it writes; one more position
of slack covers a decode step queued ahead.

A decoding mode whose request runs as several sequences bounds its request itself (Pasta:
``rollout.pasta.runtime.pasta_block_bound``).

Which chunks: the prompt is prefilled in chunks of at most ``max_num_batched_tokens`` that may start
anywhere (a first chunk takes what the step's budget leaves); after it every step writes one
position. Bounded policies are never preempted, so nothing is prefilled again; ``full`` and
``registers`` are (their bound is every position, which recomputing never exceeds).
"""

from __future__ import annotations

from functools import partial

from sliderl.core.kv_policy import KVPolicy


def block_bound(policy: KVPolicy, prompt_len: int, max_tokens: int, max_model_len: int, block_size: int,
                max_chunk: int) -> int:
    """The most blocks a sequence holds at any step, for a prompt of ``prompt_len`` tokens and up to
    ``max_tokens`` generated ones: exact over its decode steps, the worst chunking over its prefill."""
    end = kv_positions(prompt_len, max_tokens, max_model_len)
    if policy.kind == "h2o":
        budget_pages, _ = policy.budget_pages(block_size)
        unscored = -(-min(prompt_len + 2, end) // block_size)
        return min(-(-end // block_size), max(budget_pages, unscored))
    live = partial(_live_blocks, policy.kept_prefix(prompt_len), policy.window, block_size)
    prefill = _phase_peak(live, 0, prompt_len, max_chunk, block_size)
    return max(prefill, _phase_peak(live, prompt_len, end, 1, block_size))


def kv_positions(prompt_len: int, max_tokens: int, max_model_len: int) -> int:
    """How many positions may get their K/V written: the prompt and every generated token.

    The last sampled token's K/V is written only by a decode step queued before its sequence is
    known to finish (``rollout.run_ahead``); none is queued past position ``max_model_len - 2``.
    """
    return min(prompt_len + max_tokens, max_model_len - 1)


def _live_blocks(keep: int | None, window: int, block_size: int, a: int, b: int) -> int:
    """Blocks held while positions ``[a, b)`` are written (``keep``: positions that never die; None: all)."""
    last = (b - 1) // block_size
    if keep is None:
        return last + 1
    kept = min(-(-keep // block_size), last + 1)
    first_seen = max(kept, (a - window + 1) // block_size)  # first non-kept block query a still sees
    return kept + max(0, last - first_seen + 1)


def _phase_peak(live, start: int, end: int, chunk: int, block_size: int) -> int:
    """Most blocks held while positions ``[start, end)`` are written in chunks of at most ``chunk``.

    Moving a chunk ``block_size`` positions later never holds fewer blocks, and a chunk cut short by ``end`` holds
    no more than the full-length chunk that ends there, so the last ``block_size`` full-length chunk
    starts cover every chunking.
    """
    if start >= end:
        return 0
    top = max(start, end - chunk)
    return max(live(a, min(a + chunk, end)) for a in range(max(start, top - block_size + 1), top + 1))
