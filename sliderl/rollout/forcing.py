"""Teacher forcing: threads that take given tokens in place of sampled ones (``LLM.force``).

Benchmarks and tests drive the engine with a scripted response: ``llm.force(seq, tokens, thread)`` makes
thread ``thread`` of ``seq``'s request take ``tokens`` in order, one per token it would sample, then sample
as usual. Thread 0 is the request itself (under ``kv="pasta"`` its main thread); thread k >= 1 is the k-th
fork of a Pasta request, whose script starts after the ``<async>`` the runtime inserts. A forced token is
chosen on the device (a decode step queued ahead reads it there) with its logprob under the sampler's
convention (``rollout.sampling.logprobs_at``); everything after that treats it as sampled — stops,
budget forcing, Pasta tags — and the output's ``forced`` flag stays False (that flag is budget
forcing's and the runtime's).
"""

from __future__ import annotations

from sliderl.rollout.sequence import Sequence


class ForcedTokens:
    """The scripts of the requests being forced: request id -> thread index -> tokens."""

    def __init__(self):
        self.scripts: dict[int, dict[int, list[int]]] = {}

    def add(self, request_id: int, thread: int, tokens: list[int]) -> None:
        self.scripts.setdefault(request_id, {})[thread] = list(tokens)

    def discard(self, request_id: int) -> None:
        """The request finished: forget its scripts."""
        self.scripts.pop(request_id, None)

    def due(self, seqs: list[Sequence]) -> tuple[list[int], list[int]]:
        """The rows of ``seqs`` (one token each to choose) whose script has a token left, and those tokens."""
        rows, tokens = [], []
        if not self.scripts:
            return rows, tokens
        for row, seq in enumerate(seqs):
            script = self.scripts.get(seq.request_id, {}).get(seq.thread_index)
            k = seq.tokens_taken if script is not None else 0
            if script is not None and k < len(script):
                rows.append(row)
                tokens.append(script[k])
        return rows, tokens
