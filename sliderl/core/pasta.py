"""Pasta-Lang as tokens: what the engine's runtime and the trainer agree on (thesis, Pasta chapter).

A response annotated in Pasta-Lang is one *flattened* token sequence, the layout the runtime outputs
and the trainer reads:

    ... main ... <promise topic="t" tokens="N"/> <async> ... fork ... </async> ... main ... <sync/> ...

- ``<promise`` opens a promise tag; the tag's attribute text follows as ordinary tokens and ``/>``
  closes it. The promise's *predicted length* is 10·N tokens (``tokens="N"``); a promise without a
  valid ``tokens`` attribute gets ``DEFAULT_PROMISE_UNITS`` (and is counted as malformed).
- Decoding the ``/>`` that closes a promise forks a thread. The runtime appends ``<async>`` to the
  fork (the model does not sample it); the fork decodes until ``</async>``. In the flattened layout
  each fork's ``<async> … </async>`` block sits right after its promise, then the main thread's
  continuation follows.
- ``<sync/>`` makes the main thread wait until all its forks have ended; from then on it sees them.

These strings are special tokens of every tokenizer that runs Pasta (``PASTA_TOKENS``; the tiny
byte tokenizer gains them with ``core.tiny.build_tokenizer(extra_special_tokens=PASTA_TOKENS)``).

``PastaLayout`` reads one flattened response (indices below count the prompt's P tokens first):

Threads. The prompt and every token outside a fork are the main thread, 0; the i-th fork (i >= 1)
is the block ``<async> … </async>`` right after the i-th promise that got one. Forks spawn from the
main thread only (one level): inside a block, ``<promise``, ``/>`` and ``<async>`` are plain text.

Visibility (DESIGN.md, "Pasta threads"). Each thread keeps a *table* of the keys it may see, in
write order: the main thread's holds the prompt and its own tokens, and at a ``<sync/>`` it first
appends every fork not yet joined (in flattened order), then the sync token; a fork's table starts
as the main thread's table at the fork point (the promise's ``/>``, included), then its own tokens.
A query sees its thread's table as of itself, so every key it sees precedes it in flattened order.
The same rule by comparisons, what a FlexAttention ``mask_mod`` evaluates (``thread_visible``):

    q sees k  iff  k <= q  and  (thread[k] == thread[q]  or  exposed_at[k] <= view_at[q])

``exposed_at[k]`` is where k becomes visible to other threads: k itself on the main thread, the
sync that joins k's fork, never for a fork no sync joins. ``view_at[q]`` is where q's view of other
threads stops: q itself on the main thread, the fork point in a fork.

Position ids (RoPE only; Pasta-SFT's second modification). The prompt has 0..P-1 and each main
token continues the main thread's count; a fork's ``<async>`` gets the position after its
promise's ``/>`` and its tokens count on from there; the main thread's continuation after a
promise starts at position(``/>``) + 1 + UNIT·N, past the predicted length. A fork longer than
predicted overlaps the main thread's positions, which RoPE allows.

Targets (Pasta-SFT's third modification, and how the runtime samples). Every token is predicted
by the previous token of its own thread: a promise's ``/>`` predicts the first main token after
its block, a fork's first token is predicted by its ``<async>``. The ``<async>`` is inserted by
the runtime, so it is never a target.

Critical path (the thesis' theoretical speedup). Each completion token costs one decode step on
its thread; a fork starts when its ``/>`` is decoded and takes one step per block token; a sync
costs a step, then waits for the forks it joins; the response ends when the main thread and every
fork have. Speedup = a baseline's response length / this critical path.

Which ``<async>`` opens a fork. In a runtime's response the fork's ``<async>`` is inserted by the
runtime (forced), so with the response's forced flags (``PastaLayout.parse(..., forced=...)``) only a
forced ``<async>`` right after a promise opens a fork: an ``<async>`` the main thread *sampled* right
after a ``/>`` that forked nothing (past ``pasta_max_forks``, or no room under ``max_model_len``) is a
stray main-thread token, as the runtime read it. Without forced flags (SFT data written as text) every
``<async>`` right after a promise opens its fork.

Malformed pieces are plain tokens of the thread they stand in, counted in ``PastaMalformed``:
a ``<promise`` not closed by ``/>`` before another tag or the end; a promise not followed by
``<async>`` (with forced flags: by a forced one; it forks nothing and shifts no position); a fork whose
promise has no valid ``tokens="N"`` (it gets ``DEFAULT_PROMISE_UNITS``); a tag token that means nothing where it
stands (``<async>`` not right after a promise, ``</async>`` or ``/>`` on the main thread outside
a promise, ``<promise``/``/>``/``<async>`` inside a fork; one count per token); a fork never closed
(it ends at the end of the text and is never joined). A ``<sync/>`` with no fork to join is an
ordinary token of its thread and is not counted.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import astuple, dataclass

import torch
from torch import Tensor

from sliderl.core.kv_policy import NEVER

PROMISE_OPEN = "<promise"
TAG_CLOSE = "/>"
ASYNC_OPEN = "<async>"
ASYNC_CLOSE = "</async>"
SYNC = "<sync/>"
PASTA_TOKENS = (PROMISE_OPEN, TAG_CLOSE, ASYNC_OPEN, ASYNC_CLOSE, SYNC)

UNIT = 10  # a promise's tokens="N" predicts 10·N tokens (the thesis)
DEFAULT_PROMISE_UNITS = 3  # predicted 30 tokens when the attribute is missing or invalid

_TOKENS_ATTR = re.compile(r'\btokens\s*=\s*"(\d{1,6})"')


def promise_units(attributes: str) -> int | None:
    """``N`` of ``tokens="N"`` in a promise tag's attribute text, or None when absent/invalid."""
    match = _TOKENS_ATTR.search(attributes)
    return int(match.group(1)) if match else None


@dataclass(frozen=True)
class PastaTokenIds:
    """The five tag token ids of one tokenizer."""

    promise_open: int
    tag_close: int
    async_open: int
    async_close: int
    sync: int

    @classmethod
    def from_tokenizer(cls, tokenizer) -> PastaTokenIds:
        """Look the tags up; a tokenizer without them is an error naming the missing ones."""
        vocab = tokenizer.get_vocab()
        missing = [t for t in PASTA_TOKENS if t not in vocab]
        if missing:
            raise ValueError(f"tokenizer has no Pasta-Lang tokens {missing}; add {list(PASTA_TOKENS)} as special "
                             "tokens (sliderl.core.tiny.build_tokenizer(extra_special_tokens=sliderl.core.pasta.PASTA_TOKENS))")
        return cls(*(vocab[t] for t in PASTA_TOKENS))


# ---------------------------------------------------------------- the layout of one response


def thread_visible(q_thread: Tensor, q_view: Tensor, k_thread: Tensor, k_exposed: Tensor) -> Tensor:
    """The thread part of the rule (module docstring), on per-token tensors that broadcast: same thread,
    or the key was exposed to other threads at or before the query's view of them stops."""
    return (q_thread == k_thread) | (k_exposed <= q_view)


@dataclass(frozen=True)
class Fork:
    """One fork of a response, in flattened indices (prompt first)."""

    promise: tuple[int, int]  # [start, end) of ``<promise … />``; its ``/>`` (end - 1) is the fork point
    block: tuple[int, int]  # [start, end) of ``<async> … </async>``; end = the text's end when never closed
    join: int | None  # index of the ``<sync/>`` that joins it; None when none does
    units: int  # predicted length: UNIT·units tokens

    @property
    def fork_point(self) -> int:
        return self.promise[1] - 1


@dataclass(frozen=True)
class PastaMalformed:
    """How many pieces of a response break Pasta-Lang, by kind (module docstring, last paragraph)."""

    stray_tags: int = 0  # tag tokens read as plain text where they stand
    unclosed_promises: int = 0  # ``<promise`` not closed by ``/>`` before another tag or the end
    promises_without_block: int = 0  # a promise not followed by ``<async>``: forks nothing
    promises_without_units: int = 0  # a fork whose promise has no valid tokens="N": DEFAULT_PROMISE_UNITS
    unclosed_forks: int = 0  # a fork that never reaches ``</async>``: ends at the end of the text

    @property
    def total(self) -> int:
        return sum(astuple(self))


@dataclass(frozen=True)
class PastaLayout:
    """Threads, position ids, forks and malformed pieces of one flattened response (module docstring).

    Built by ``PastaLayout.parse``; every per-token tensor is int64 ``[P + T]`` over the prompt then
    the completion, in flattened (write) order.
    """

    prompt_len: int
    thread: Tensor  # 0 on the main thread, i on the i-th fork
    positions: Tensor  # RoPE position ids
    forks: tuple[Fork, ...]
    malformed: PastaMalformed

    @classmethod
    def parse(cls, prompt_len: int, completion_ids: Sequence[int] | Tensor, tags: PastaTokenIds,
              decode: Callable[[list[int]], str], forced: Sequence[bool] | None = None) -> PastaLayout:
        """Read ``completion_ids`` after a prompt of ``prompt_len`` tokens, in one pass.

        tags: the tokenizer's tag ids. decode: token ids -> text (``tokenizer.decode``), used on each
        promise's attribute tokens to read ``tokens="N"``. forced: the runtime's forced flags of the
        completion (``RequestOutput.forced``, ``Trace.forced``); given (non-empty), only a forced ``<async>``
        opens a fork (module docstring); None or empty: SFT text, any ``<async>`` after a promise does.
        """
        ids, flags = parse_input(prompt_len, completion_ids, forced)
        return _LayoutParser(prompt_len, ids, tags, decode, flags).run()

    def __len__(self) -> int:
        return self.thread.shape[0]

    @property
    def num_generated(self) -> int:
        return len(self) - self.prompt_len

    def exposed_at(self) -> Tensor:
        """``[P + T]``: where each key becomes visible to other threads (itself on the main thread, its
        fork's join, ``NEVER`` for a fork never joined)."""
        exposed = torch.arange(len(self))
        for fork in self.forks:
            exposed[fork.block[0]:fork.block[1]] = NEVER if fork.join is None else fork.join
        return exposed

    def view_at(self) -> Tensor:
        """``[P + T]``: where each query's view of other threads stops (itself on the main thread, its
        fork point in a fork)."""
        view = torch.arange(len(self))
        for fork in self.forks:
            view[fork.block[0]:fork.block[1]] = fork.fork_point
        return view

    def mask_mod(self):
        """The rule as a FlexAttention ``mask_mod(b, h, q_idx, kv_idx)`` over flattened indices."""
        thread, exposed, view = self.thread, self.exposed_at(), self.view_at()

        def visible(b, h, q_idx, kv_idx):
            return (kv_idx <= q_idx) & thread_visible(thread[q_idx], view[q_idx], thread[kv_idx], exposed[kv_idx])

        return visible

    def dense_mask(self) -> Tensor:
        """``[P + T, P + T]`` bool, True where query row i sees key column j, built from the threads' tables."""
        n = len(self)
        mask = torch.zeros(n, n, dtype=torch.bool)
        joined = self._joined_at()
        tables = {0: torch.zeros(n, dtype=torch.bool)}  # thread -> the keys it may see so far
        for i, t in enumerate(self.thread.tolist()):
            if t == 0:
                for f in joined.get(i, []):
                    tables[0][slice(*self.forks[f].block)] = True
            elif t not in tables:  # a fork's first token: the main table as of its fork point, just before
                tables[t] = tables[0].clone()
            tables[t][i] = True
            mask[i] = tables[t]
        return mask

    def predictor_index(self) -> Tensor:
        """``[T]``: for each completion token, the flattened index whose logits predict it — the previous
        token of its thread; for a fork's ``<async>`` (never a target) the token before it."""
        last: dict[int, int] = {0: self.prompt_len - 1}
        out = []
        for i, t in enumerate(self.thread.tolist()[self.prompt_len:], start=self.prompt_len):
            out.append(last.get(t, i - 1))
            last[t] = i
        return torch.tensor(out, dtype=torch.int64)

    def target_mask(self) -> Tensor:
        """``[T]`` bool: False on each fork's ``<async>`` (inserted by the runtime, never a target)."""
        mask = torch.ones(self.num_generated, dtype=torch.bool)
        for fork in self.forks:
            mask[fork.block[0] - self.prompt_len] = False
        return mask

    @property
    def critical_path(self) -> int:
        """Decode steps of the longest sequential chain of the completion (module docstring)."""
        starts = {fork.fork_point: f for f, fork in enumerate(self.forks)}
        joined = self._joined_at()
        ends: dict[int, int] = {}  # fork -> the step its last block token is decoded
        step, thread = 0, self.thread.tolist()
        for i in range(self.prompt_len, len(self)):
            if thread[i] != 0:
                continue
            step += 1
            if i in starts:
                block = self.forks[starts[i]].block
                ends[starts[i]] = step + block[1] - block[0]
            step = max([step, *(ends[f] for f in joined.get(i, []))])
        return max([step, *ends.values()])

    def _joined_at(self) -> dict[int, list[int]]:
        """Index of each joining ``<sync/>`` -> the forks it joins."""
        joined: dict[int, list[int]] = {}
        for f, fork in enumerate(self.forks):
            if fork.join is not None:
                joined.setdefault(fork.join, []).append(f)
        return joined

    def speedup(self, baseline_len: int) -> float:
        """The theoretical speedup over a sequential response of ``baseline_len`` tokens (e.g. Baseline-SFT's):
        ``baseline_len / critical_path``."""
        if baseline_len < 0:
            raise ValueError(f"baseline_len must be >= 0 tokens, got {baseline_len}")
        if self.critical_path == 0:
            raise ValueError("an empty response has no critical path; the speedup needs at least one completion token")
        return baseline_len / self.critical_path


def parse_input(prompt_len: int, completion_ids: Sequence[int] | Tensor,
                forced: Sequence[bool] | None) -> tuple[list[int], list[bool] | None]:
    """A layout parser's checked input (Pasta's and Planned Diffusion's): the completion's ids as a list and its
    forced flags, None where none were given (or an empty list: SFT text)."""
    if isinstance(prompt_len, bool) or not isinstance(prompt_len, int) or prompt_len < 1:
        raise ValueError(f"prompt_len must be an int >= 1 (a response follows its prompt), got {prompt_len!r}")
    ids = completion_ids.tolist() if isinstance(completion_ids, Tensor) else list(completion_ids)
    flags = [bool(f) for f in forced] if forced is not None else []
    if flags and len(flags) != len(ids):
        raise ValueError(f"forced has {len(flags)} flags for {len(ids)} completion tokens")
    return ids, flags or None


class _LayoutParser:
    """One pass over a completion for ``PastaLayout.parse``: the main thread reads tags, a fork only waits
    for its ``</async>``."""

    def __init__(self, prompt_len: int, ids: list[int], tags: PastaTokenIds, decode: Callable[[list[int]], str],
                 forced: list[bool] | None = None):
        self.prompt_len, self.ids, self.tags, self.decode, self.forced = prompt_len, ids, tags, decode, forced
        self.tag_ids = set(astuple(tags))
        self.thread, self.positions = [0] * prompt_len, list(range(prompt_len))
        self.main_next = prompt_len  # position of the main thread's next token
        self.fork_next = 0  # position of the open fork's next token
        self.tag_start: int | None = None  # index of a ``<promise`` whose ``/>`` has not come yet
        self.promised: tuple[int, int, int | None] | None = None  # (start, fork point, units) closed by the last token
        self.forks: list[list] = []  # [promise, block start, block end, join, units], frozen into Fork at the end
        self.open_fork: int | None = None  # index into forks of the block being read
        self.unjoined: list[int] = []
        self.counts = dict.fromkeys(PastaMalformed.__dataclass_fields__, 0)

    def run(self) -> PastaLayout:
        for j, tok in enumerate(self.ids):
            if self.open_fork is None:
                self._main(self.prompt_len + j, tok)
            else:
                self._fork(self.prompt_len + j, tok)
        self._end()
        forks = tuple(Fork(promise, (start, end), join, units) for promise, start, end, join, units in self.forks)
        return PastaLayout(self.prompt_len, torch.tensor(self.thread, dtype=torch.int64),
                           torch.tensor(self.positions, dtype=torch.int64), forks, PastaMalformed(**self.counts))

    def _main(self, i: int, tok: int) -> None:
        promised, self.promised = self.promised, None
        if promised is not None:
            if tok == self.tags.async_open and (self.forced is None or self.forced[i - self.prompt_len]):
                return self._start_fork(i, *promised)
            self.counts["promises_without_block"] += 1
        if self.tag_start is not None:
            if tok not in self.tag_ids:  # attribute text
                return self._main_token(i)
            if tok == self.tags.tag_close:
                text = self.decode(self.ids[self.tag_start + 1 - self.prompt_len:i - self.prompt_len])
                self.promised = (self.tag_start, i, promise_units(text))
                self.tag_start = None
                return self._main_token(i)
            self.counts["unclosed_promises"] += 1
            self.tag_start = None
        if tok == self.tags.promise_open:
            self.tag_start = i
        elif tok == self.tags.sync:
            for f in self.unjoined:
                self.forks[f][3] = i
            self.unjoined = []
        elif tok in self.tag_ids:  # <async> without a promise, </async> or /> outside a tag
            self.counts["stray_tags"] += 1
        self._main_token(i)

    def _main_token(self, i: int) -> None:
        self.thread.append(0)
        self.positions.append(self.main_next)
        self.main_next += 1

    def _start_fork(self, i: int, start: int, point: int, units: int | None) -> None:
        if units is None:
            self.counts["promises_without_units"] += 1
            units = DEFAULT_PROMISE_UNITS
        self.fork_next = self.positions[point] + 1
        self.main_next = self.fork_next + UNIT * units
        self.forks.append([(start, point + 1), i, None, None, units])
        self.open_fork = len(self.forks) - 1
        self._fork_token()

    def _fork(self, i: int, tok: int) -> None:
        self._fork_token()
        if tok == self.tags.async_close:
            self.forks[self.open_fork][2] = i + 1
            self.unjoined.append(self.open_fork)
            self.open_fork = None
        elif tok in self.tag_ids and tok != self.tags.sync:  # one level of forks: nested tags are text
            self.counts["stray_tags"] += 1

    def _fork_token(self) -> None:
        self.thread.append(self.open_fork + 1)
        self.positions.append(self.fork_next)
        self.fork_next += 1

    def _end(self) -> None:
        n = self.prompt_len + len(self.ids)
        self.counts["unclosed_promises"] += self.tag_start is not None
        self.counts["promises_without_block"] += self.promised is not None
        if self.open_fork is not None:
            self.counts["unclosed_forks"] += 1
            self.forks[self.open_fork][2] = n
