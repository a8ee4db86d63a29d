"""KV retention policies: the one visibility rule shared by the engine, the kernels and the trainer.

Every policy reduces to one number per key position k, its *death* d(k): the first query position
that can no longer see k. A query at position q sees key k exactly when ``k <= q < d(k)``.

| spec               | d(k)                                                        |
|--------------------|-------------------------------------------------------------|
| full               | never                                                       |
| prefix_sliding:W   | never if k < P, else k + W        (P = prompt length)       |
| sliding_window:W   | k + W                                                       |
| streaming:S:W      | never if k < S, else k + W                                  |
| registers:N        | the position r of the register token that killed k's step   |
| h2o:B              | never by itself; the position where the engine evicted k's page |
| pasta              | never (``full``); Pasta threads add the thread rule (``core.pasta``) |
| last_k:N:K         | never within a segment; segments restart (``core.restart``)  |
| summary:N:S        | never within a segment; segments restart (``core.restart``)  |
| planned_diffusion  | never (``full``); Planned Diffusion's spans add the span rule (``core.planned_diffusion``) |

``q - k < W`` is the window convention: a query sees W keys including itself.

Paged H2O (``h2o:B``, a TIP baseline): evictions follow accumulated attention mass, not token ids,
so ``death_positions`` alone gives never; the engine records each evicted page as a range
``(start, end, death)`` (``RequestOutput.kv_deaths``, ``Trace.kv_deaths``) and ``death_positions(...,
recorded=...)`` applies those ranges on top, so the trainer rebuilds the sampler's mask from the
trace. The budget B counts tokens in whole pages; ``rollout.heavy_hitters`` says which pages stay.

Restarts (the Prefix Sliding paper's baselines, its Appendix G): under ``last_k:N:K`` and ``summary:N:S`` the
generated part of the context holds at most N tokens; then generation restarts from a new context (the prompt and
the last K generated tokens, or the prompt with the model's summary inserted), whose tokens are encoded afresh at
positions right after the prompt. Inside one context every key is visible (death never); a key of an old context is
dead from the restart on. A trace is scored segment by segment, each under its own context (``core.restart``).

Registers (TIP): a step starts at a generated ``<reg_i>`` token and runs until the next register
token or the end-of-thinking token (exclusive). When ``<reg_i>`` is emitted at position r while an
earlier step still holds ``<reg_i>``, that step (its register token included) dies at r. The
prompt and tokens outside steps never die, so at most N steps are live.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import torch

NEVER = 2**31 - 1  # death of a key that stays visible forever (fits int32 kernels)
MAX_SPEC_ARG = 2**30  # a spec's W, S, N or B: position + W stays below NEVER for any position below it

POLICY_KINDS = ("full", "prefix_sliding", "sliding_window", "streaming", "registers", "h2o", "pasta", "last_k",
                "summary", "planned_diffusion")
RESTART_KINDS = ("last_k", "summary")
SPEC_HELP = ("valid specs: full, prefix_sliding:W, sliding_window:W, streaming:S:W, registers:N, h2o:B, pasta, "
             "last_k:N:K, summary:N:S, planned_diffusion (W, N, B >= 1; S >= 0; the engine needs B >= 2 x block_size; "
             "last_k: 1 <= K < N; summary: 2 <= S < N)")


def register_tokens(num_registers: int) -> list[str]:
    """The special tokens ``<reg_0> … <reg_{N-1}>`` that the registers policy adds to the vocabulary."""
    return [f"<reg_{i}>" for i in range(num_registers)]


@dataclass(frozen=True)
class KVPolicy:
    """A parsed KV policy spec; see the module docstring for the rule."""

    kind: str
    window: int = 0
    sinks: int = 0
    num_registers: int = 0
    budget: int = 0  # h2o: live KV tokens per request, in whole pages
    restart_at: int = 0  # last_k / summary: N, the most generated tokens a context holds
    carry: int = 0  # last_k: K, the generated tokens kept at a restart; summary: S, the most tokens of its tool call
    register_ids: tuple[int, ...] = field(default=(), compare=False)
    end_think_id: int | None = field(default=None, compare=False)

    @classmethod
    def parse(cls, spec: str | KVPolicy) -> KVPolicy:
        """Parse ``full``, ``prefix_sliding:W``, ``sliding_window:W``, ``streaming:S:W``, ``registers:N``, ``h2o:B``,
        ``pasta`` (``full`` plus Pasta-Lang threads: ``core.pasta``), ``last_k:N:K`` or ``summary:N:S`` (restarts:
        ``core.restart``), or ``planned_diffusion`` (``full`` plus Planned Diffusion's spans:
        ``core.planned_diffusion``)."""
        if isinstance(spec, KVPolicy):
            return spec
        if not isinstance(spec, str):
            raise ValueError(f"KV policy spec must be a string, got {spec!r}; {SPEC_HELP}")
        kind, *args = spec.strip().split(":")
        arity = {"full": 0, "prefix_sliding": 1, "sliding_window": 1, "streaming": 2, "registers": 1, "h2o": 1,
                 "pasta": 0, "last_k": 2, "summary": 2, "planned_diffusion": 0}
        if kind not in arity:
            raise ValueError(f"unknown KV policy {kind!r} in spec {spec!r}; {SPEC_HELP}")
        if len(args) != arity[kind]:
            raise ValueError(f"KV policy spec {spec!r} takes {arity[kind]} integer argument(s); {SPEC_HELP}")
        values = [_spec_int(a, spec) for a in args]
        if kind == "streaming":
            sinks, window = values
            if sinks < 0:
                raise ValueError(f"streaming sinks must be >= 0, got {sinks} in {spec!r}; {SPEC_HELP}")
            return cls(kind, window=_positive(window, "window", spec), sinks=sinks)
        if kind in RESTART_KINDS:
            return cls._restart(kind, *values, spec)
        if kind == "registers":
            return cls(kind, num_registers=_positive(values[0], "number of registers", spec))
        if kind == "h2o":
            return cls(kind, budget=_positive(values[0], "budget", spec))
        if kind in ("full", "pasta", "planned_diffusion"):
            return cls(kind)
        return cls(kind, window=_positive(values[0], "window", spec))

    @classmethod
    def _restart(cls, kind: str, n: int, carry: int, spec: str) -> KVPolicy:
        """``last_k:N:K`` (1 <= K < N) or ``summary:N:S`` (2 <= S < N: the call's opening and closing tokens fit)."""
        least = 1 if kind == "last_k" else 2
        name = "K (tokens kept)" if kind == "last_k" else "S (most tokens of the summary call)"
        if not least <= carry < n:
            raise ValueError(f"{kind} needs {least} <= {name} < N, got N={n}, {carry} in {spec!r}; {SPEC_HELP}")
        return cls(kind, restart_at=n, carry=carry)

    @property
    def spec(self) -> str:
        """The canonical spec string (what traces store)."""
        return {
            "full": "full",
            "prefix_sliding": f"prefix_sliding:{self.window}",
            "sliding_window": f"sliding_window:{self.window}",
            "streaming": f"streaming:{self.sinks}:{self.window}",
            "registers": f"registers:{self.num_registers}",
            "h2o": f"h2o:{self.budget}",
            "pasta": "pasta",
            "last_k": f"last_k:{self.restart_at}:{self.carry}",
            "summary": f"summary:{self.restart_at}:{self.carry}",
            "planned_diffusion": "planned_diffusion",
        }[self.kind]

    def bind(self, register_ids: list[int] | tuple[int, ...] = (), end_think_id: int | None = None) -> KVPolicy:
        """Attach the token ids the registers policy needs (``<reg_i>`` ids in order, end-of-thinking id)."""
        if self.kind == "registers" and len(register_ids) != self.num_registers:
            raise ValueError(f"{self.spec} needs {self.num_registers} register token ids, got {len(register_ids)}")
        return replace(self, register_ids=tuple(register_ids), end_think_id=end_think_id)

    @property
    def bounded(self) -> bool:
        """Keys die ``window`` positions after they are written, except a kept prefix: a sequence's
        live KV is bounded whatever its length (prefix_sliding, sliding_window, streaming)."""
        return self.kind in ("prefix_sliding", "sliding_window", "streaming")

    @property
    def admits_by_bound(self) -> bool:
        """A sequence's live blocks have a bound known at admission, so the scheduler reserves it and never
        preempts: the windowed policies, h2o (its budget), the restart policies, and planned_diffusion (every
        position it may write: a span's KV is written by the runtime's own forward, which a recompute by prefill
        could not redo)."""
        return self.bounded or self.kind in ("h2o", "planned_diffusion") or self.restarts

    @property
    def restarts(self) -> bool:
        """Generation restarts from a new context whenever the generated part of the context reaches N tokens
        (``last_k``, ``summary``: ``core.restart``)."""
        return self.kind in RESTART_KINDS

    def budget_pages(self, block_size: int) -> tuple[int, int]:
        """h2o: (pages a decode step may hold, most recent pages always kept) for ``block_size``-token pages.

        B counts tokens in whole pages: ``B // block_size`` pages; the most recent ``(B // 2) // block_size``
        (at least one, the page being written) are always kept, the rest of the budget holds heavy pages.
        """
        if self.kind != "h2o":
            raise ValueError(f"budget_pages is for h2o, not {self.spec}")
        if self.budget < 2 * block_size:
            raise ValueError(f"KV policy {self.spec} needs a budget of at least 2 pages, B >= 2 x block_size = "
                             f"{2 * block_size}; raise B or lower block_size; {SPEC_HELP}")
        return self.budget // block_size, max(1, self.budget // 2 // block_size)

    def kept_prefix(self, prompt_len: int) -> int | None:
        """How many leading positions never die (the rest die at ``k + window``); None for the unbounded
        policies, whose keys live until a token kills them (registers), the engine evicts them (h2o) or
        forever (full)."""
        if not self.bounded:
            return None
        return {"prefix_sliding": prompt_len, "streaming": self.sinks, "sliding_window": 0}[self.kind]

    def tracker(self, prompt_len: int) -> DeathTracker:
        """A fresh incremental follower of one sequence with a prompt of ``prompt_len`` tokens."""
        return DeathTracker(self, prompt_len)

    def death_positions(self, prompt_len: int, token_ids: list[int] | torch.Tensor,
                        recorded: Sequence[tuple[int, int, int]] = ()) -> torch.Tensor:
        """d(k) for every position of a whole sequence (prompt + completion): int64 ``[T]``.

        ``recorded``: deaths the engine decided (h2o's evicted pages) as ``(start, end, death)`` ranges;
        positions ``start .. end - 1`` die at ``death`` unless the policy kills them earlier.
        """
        ids = token_ids.tolist() if isinstance(token_ids, torch.Tensor) else list(token_ids)
        if self.kind == "registers":  # deaths follow the register tokens: walk the sequence
            tracker = self.tracker(prompt_len)
            for pos, tok in enumerate(ids):
                tracker.append(pos, tok)
            death = torch.tensor(tracker.death, dtype=torch.int64)
        else:  # DeathTracker.initial_death for every position at once: a per-token walk costs ~5 us a token,
            # ~1.4 s per learner step of 32 traces of 8K tokens
            death = self._initial_deaths(prompt_len, len(ids))
        for start, end, at in recorded:
            if not 0 <= start < end <= len(ids) or not end <= at:
                raise ValueError(f"recorded death range ({start}, {end}, {at}) does not fit a sequence of {len(ids)} "
                                 "positions (need 0 <= start < end <= length and death >= end)")
            death[start:end] = death[start:end].clamp(max=at)
        return death

    def _initial_deaths(self, prompt_len: int, length: int) -> torch.Tensor:
        """``DeathTracker.initial_death`` of positions ``0 .. length - 1``: never inside the kept prefix (or for an
        unbounded policy), else ``position + window``."""
        keep = self.kept_prefix(prompt_len)
        pos = torch.arange(length, dtype=torch.int64)
        if keep is None:
            return torch.full((length,), NEVER, dtype=torch.int64)
        return torch.where(pos < keep, torch.full_like(pos, NEVER), pos + self.window)


def _spec_int(text: str, spec: str) -> int:
    """One argument of a spec: a whole number in ASCII digits, at most ``MAX_SPEC_ARG`` (checks of sign later)."""
    text = text.strip()
    if not text:
        raise ValueError(f"KV policy spec {spec!r} has an empty argument (e.g. prefix_sliding: without its window); "
                         f"{SPEC_HELP}")
    if not re.fullmatch(r"-?[0-9]+", text):
        raise ValueError(f"KV policy spec {spec!r} has a non-integer argument {text!r}; {SPEC_HELP}")
    if int(text) > MAX_SPEC_ARG:
        raise ValueError(f"KV policy spec {spec!r}: {text} is beyond the largest argument, {MAX_SPEC_ARG} (2^30); a "
                         f"window longer than every sequence keeps every token: use full; {SPEC_HELP}")
    return int(text)


def _positive(value: int, what: str, spec: str) -> int:
    if value <= 0:
        raise ValueError(f"{what} must be >= 1, got {value} in KV policy spec {spec!r}; {SPEC_HELP}")
    return value


class DeathTracker:
    """Follows one sequence token by token and keeps d(k) for every position seen so far.

    ``append`` returns the position ranges ``[start, end)`` that died at this token (registers only):
    the engine frees or masks their KV, the trainer needs nothing more than ``death``. ``evict`` sets
    deaths the engine decided (h2o).
    ``visible`` is the number of keys the query at the last appended position sees.
    """

    def __init__(self, policy: KVPolicy, prompt_len: int):
        if policy.kind == "registers" and len(policy.register_ids) != policy.num_registers:
            raise ValueError(f"{policy.spec} is not bound to register token ids; call policy.bind(...) first")
        self.policy = policy
        self.prompt_len = prompt_len
        self.death: list[int] = []
        self._register_index = {tok: i for i, tok in enumerate(policy.register_ids)}
        self._holder: dict[int, tuple[int, int]] = {}  # register -> (start, end) of its live step; end=-1 open
        self._open: int | None = None  # register whose step is still growing
        # register i's live step as (start, end) positions, end NEVER while it grows, (0, 0) for none: what a query
        # whose input token is <reg_i> must not see although the cache's deaths do not say so yet (a decode step
        # queued before that token was read back: kernels.metadata.register_kills)
        self.register_ranges = np.zeros((policy.num_registers if policy.kind == "registers" else 0, 2), np.int32)
        self._dying: dict[int, int] = {}  # death position -> number of keys that die there
        self.visible = 0

    def initial_death(self, pos: int) -> int:
        """d(pos) as known when the token at ``pos`` is written."""
        keep = self.policy.kept_prefix(self.prompt_len)
        return NEVER if keep is None or pos < keep else pos + self.policy.window

    def append(self, pos: int, token_id: int) -> list[tuple[int, int]]:
        assert pos == len(self.death), (pos, len(self.death))
        death = self.initial_death(pos)
        self.death.append(death)
        if death != NEVER:
            self._dying[death] = self._dying.get(death, 0) + 1
        killed = self._follow_registers(pos, token_id)
        self.visible += 1 - self._dying.pop(pos, 0)
        return killed

    def evict(self, start: int, end: int, death: int) -> None:
        """Positions ``start .. end - 1`` die at ``death`` (h2o: their page was evicted before the query at ``death``).

        ``death`` is the next query position: the last appended one (its query not yet counted as seen) or later.
        """
        assert end <= death and death >= len(self.death) - 1, (start, end, death, len(self.death))
        for k in range(start, end):
            assert self.death[k] == NEVER, (k, self.death[k])
            self.death[k] = death
        if death == len(self.death) - 1:
            self.visible -= end - start
        else:
            self._dying[death] = self._dying.get(death, 0) + end - start

    def _follow_registers(self, pos: int, token_id: int) -> list[tuple[int, int]]:
        if self.policy.kind != "registers" or pos < self.prompt_len:
            return []
        reg = self._register_index.get(token_id)
        if reg is None:
            if token_id == self.policy.end_think_id:
                self._close(pos)
            return []
        self._close(pos)
        killed = []
        if reg in self._holder:
            start, end = self._holder.pop(reg)
            for k in range(start, end):
                self.death[k] = pos
            self._dying[pos] = self._dying.get(pos, 0) + end - start
            killed.append((start, end))
        self._holder[reg] = (pos, -1)
        self.register_ranges[reg] = (pos, NEVER)
        self._open = reg
        return killed

    def _close(self, pos: int) -> None:
        if self._open is not None:
            start, _ = self._holder[self._open]
            self._holder[self._open] = (start, pos)
            self.register_ranges[self._open, 1] = pos
            self._open = None

    @property
    def live_steps(self) -> int:
        return len(self._holder)
