"""What happens to a sequence once its token is sampled: append it (or the token budget forcing puts
in its place), apply register kills, stop on eos / stop ids / stop strings / length, finish, free
the blocks no future query sees. The engine's decoding mode (``rollout.mode``) decides what a sampled
token does to its request and builds the record of a finished one; the plain mode uses the steps here."""

from __future__ import annotations

import time

import torch

from sliderl.core.logprob import logprobs_at
from sliderl.rollout.mode import DecodingMode
from sliderl.rollout.scheduler import ScheduledBatch, Scheduler
from sliderl.rollout.sequence import RequestOutput, Sequence, Status


class Postprocessor:
    """Turns one step's sampled tokens into sequence state.

    ``set_death(slots, death)`` writes the death of cached keys (``ModelRunner.set_death``); ``mode`` is the
    engine's decoding mode, which takes each sampled token.
    """

    def __init__(self, tokenizer, eos_ids: set[int], max_model_len: int, scheduler: Scheduler, set_death,
                 mode: DecodingMode):
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.max_model_len = max_model_len
        self.scheduler = scheduler
        self.set_death = set_death
        self.mode = mode
        self._encoded: dict[str, tuple[int, ...]] = {}
        self.num_kills = 0  # tokens that killed a register step

    def __call__(self, batch: ScheduledBatch, rows: list[int], tokens: list[int], logprobs: list[float],
                 logits: torch.Tensor) -> list[Sequence]:
        """Append the tokens sampled for ``batch``'s ``rows`` (``logits`` their rows); the sequences that
        finished."""
        batch.mark_computed()
        finished = []
        for row, i in enumerate(rows):
            seq = batch.seqs[i]
            if self.mode.take(self, seq, tokens[row], logprobs[row], logits[row]):
                finished.append(seq)
        finished = self.mode.end_step(batch, finished)
        for seq in batch.seqs:
            if seq.status is Status.RUNNING:
                self.scheduler.free_dead_blocks(seq)
        return finished

    def append(self, seq: Sequence, token: int, logprob: float, logits: torch.Tensor) -> None:
        """Record the token (or the one budget forcing puts in its place); a register kill it causes is applied
        (a decode step queued before this token was read masked the killed step itself: ``metadata.register_kills``)."""
        p = seq.params
        if p.max_thinking_tokens is not None and not seq.thinking_done and not seq.pending_forced \
                and seq.num_output >= p.max_thinking_tokens:
            seq.pending_forced = list(self._token_ids(p.think_end))
        forced = bool(seq.pending_forced)
        if forced:
            token = seq.pending_forced.pop(0)
            temp = torch.tensor([p.temperature], device=logits.device)
            logprob = float(logprobs_at(logits[None], torch.tensor([token], device=logits.device), temp)[0])
        killed = seq.append_token(token, logprob, forced)
        if p.max_thinking_tokens is not None and not seq.thinking_done:
            end = list(self._token_ids(p.think_end))
            seq.thinking_done = seq.output_token_ids[-len(end):] == end
        if killed:
            self._kill(seq, killed)
            self.num_kills += 1

    def _token_ids(self, text: str) -> tuple[int, ...]:
        """Token ids of ``text`` (cached: budget forcing asks for them every step)."""
        if text not in self._encoded:
            self._encoded[text] = tuple(self.tokenizer.encode(text, add_special_tokens=False))
        return self._encoded[text]

    def _kill(self, seq: Sequence, ranges: list[tuple[int, int]]) -> None:
        """Registers: cached keys of a dead step get their death; complete blocks may now be freed."""
        bs, r = seq.block_size, len(seq.token_ids) - 1
        slots, touched = [], set()
        for start, end in ranges:
            for p in range(start, min(end, seq.num_computed)):
                if p // bs in seq.blocks:
                    slots.append(seq.blocks[p // bs] * bs + p % bs)
                    touched.add(p // bs)
        if slots:
            self.set_death(slots, r)
        for j in touched:
            if (j + 1) * bs <= seq.num_computed:
                seq.push_free_candidate(j)

    def stops(self, seq: Sequence) -> bool:
        """Whether ``seq``'s last token ends it (eos, a stop token or string, its length); sets its finish reason."""
        p, token = seq.params, seq.token_ids[-1]
        if not seq.forced[-1] and ((token in self.eos_ids and not p.ignore_eos) or token in (p.stop_token_ids or ())):
            seq.finish_reason = "stop"
        elif p.stop and self._stop_string(seq) is not None:
            seq.finish_reason = "stop"
        elif seq.num_output >= p.max_tokens or seq.last_position >= self.max_model_len - 1:
            seq.finish_reason = "length"
        return seq.finish_reason is not None

    def _stop_string(self, seq: Sequence, text: str | None = None) -> int | None:
        """Index in ``text`` (default: the decoded tail) where the earliest stop string starts."""
        if text is None:
            tail = max(len(s) for s in seq.params.stop) + 4
            text = self.tokenizer.decode(seq.output_token_ids[-tail:])
        hits = [text.find(s) for s in seq.params.stop if s in text]
        return min(hits) if hits else None

    def finish(self, seq: Sequence) -> None:
        """``seq``'s request is done: it leaves the scheduler and its KV use is summed up."""
        self.scheduler.finish(seq)
        n = max(seq.num_output, 1)
        seq.kv.mean_visible_tokens = seq.visible_sum / n
        seq.kv.token_steps = seq.visible_sum
        seq.finished_at = time.perf_counter()

    def output(self, seq: Sequence) -> RequestOutput:
        """The output record of a finished request (the mode's)."""
        return self.mode.output(self, seq)

    def text(self, seq: Sequence, out: list[int], cut: bool = True) -> str:
        """``out`` decoded without a final eos (when ``seq`` stopped on it), cut at a stop string unless not ``cut``."""
        shown = out[:-1] if out and out[-1] in self.eos_ids and seq.finish_reason == "stop" else out
        text = self.tokenizer.decode(shown)
        if cut and seq.params.stop:
            at = self._stop_string(seq, text)
            text = text if at is None else text[:at]
        return text
