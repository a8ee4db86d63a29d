"""Pasta-Lang annotations and the decode schedule the Pasta runtime gives them (thesis, Pasta chapter).

Tags: ``<promise .../>`` declares an asynchronous chunk and forks a thread for it; the chunk itself
is the next ``<async ...>…</async>`` block of the same thread; ``<sync/>`` makes the thread wait
until every fork it started has finished. Layout read here (the Pasta-SFT layout): each async
block follows its promise, blocks pair with their thread's promises in order, and blocks may nest
(a fork may promise and fork again).

Timing, with unlimited parallel threads: every token costs one decode step on the thread that
produces it (tags included, ``<async>``/``</async>`` on the fork); a fork starts right after its
promise; a sync waits for the thread's outstanding forks, then continues; a thread finishes when
its own forks have (the end of the response is an implicit sync). The critical path is the root
thread's finish time. For text without tags it equals the token count.

Malformed text is scored leniently and counted: an async block with no promise to pair forks where
it stands, a promise that never gets a block forks nothing, a stray ``</async>`` is a plain token,
and an unclosed block closes at the end of the text.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

TAG = re.compile(
    r"(?P<promise><promise\b[^>]*?/>)|(?P<open><async\b[^>]*>)|(?P<close></async\s*>)|(?P<sync><sync\s*/>)"
)


MAX_NESTING = 64  # deeper <async> blocks count as malformed plain tags (keeps degenerate text from recursing)


def whitespace_tokens(text: str) -> int:
    """Default token count: whitespace-separated words."""
    return len(text.split())


@dataclass
class Thread:
    """A decode thread: ``steps`` are ``(kind, cost)`` with kind text|tag|promise|sync, or a child Thread."""

    steps: list = field(default_factory=list)


@dataclass(frozen=True)
class PastaSchedule:
    """The annotated response's size and its critical path under the Pasta runtime."""

    num_tokens: int  # every token, tags included
    num_control_tokens: int  # tokens inside tags
    critical_path: int  # decode steps on the longest sequential chain
    num_forks: int
    num_malformed: int

    @property
    def speedup(self) -> float:
        """Generated tokens / critical path (1.0 for a plain or empty response)."""
        return self.num_tokens / self.critical_path if self.critical_path else 1.0

    @property
    def parallelism(self) -> float:
        """Non-control tokens / critical path (the thesis' theoretical parallelism)."""
        return (self.num_tokens - self.num_control_tokens) / self.critical_path if self.critical_path else 1.0


def schedule(text: str, count_tokens: Callable[[str], int] = whitespace_tokens) -> PastaSchedule:
    """Parse Pasta-Lang ``text`` and time it; ``count_tokens`` turns a text span into its token count."""
    pieces = _pieces(text, count_tokens)
    root, _, malformed = _parse_thread(pieces, 0, depth=0)
    path, forks, unpaired = _finish(root, 0)
    return PastaSchedule(
        num_tokens=sum(cost for _, cost in pieces),
        num_control_tokens=sum(cost for kind, cost in pieces if kind != "text"),
        critical_path=path,
        num_forks=forks,
        num_malformed=malformed + unpaired,
    )


def _pieces(text: str, count_tokens: Callable[[str], int]) -> list[tuple[str, int]]:
    """Split into ``(kind, cost)``: kind text|promise|open|close|sync; a tag costs at least 1."""
    pieces, at = [], 0
    for match in TAG.finditer(text):
        if match.start() > at:
            pieces.append(("text", count_tokens(text[at : match.start()])))
        pieces.append((match.lastgroup, max(1, count_tokens(match.group()))))
        at = match.end()
    if at < len(text):
        pieces.append(("text", count_tokens(text[at:])))
    return pieces


def _parse_thread(pieces: list[tuple[str, int]], i: int, depth: int) -> tuple[Thread, int, int]:
    """Read one thread (``depth`` 0: the main thread) from pieces[i:] -> (thread, index after it, malformed).

    A fork's thread starts after its ``<async>`` (whose cost the caller puts first) and ends at its
    ``</async>``.
    """
    thread, malformed, inside_fork = Thread(), 0, depth > 0
    while i < len(pieces):
        kind, cost = pieces[i]
        if kind == "open" and depth >= MAX_NESTING:
            malformed, kind = malformed + 1, "tag"
        if kind == "open":
            child, i, bad = _parse_thread(pieces, i + 1, depth + 1)
            child.steps.insert(0, ("tag", cost))
            thread.steps.append(child)
            malformed += bad
            continue
        if kind == "close":
            if inside_fork:
                thread.steps.append(("tag", cost))
                return thread, i + 1, malformed
            malformed += 1  # a stray </async> in a thread that is not a fork
            kind = "tag"
        thread.steps.append((kind, cost))  # text | promise | sync | tag
        i += 1
    return thread, i, malformed + inside_fork  # a fork still open at the end of the text


def _finish(thread: Thread, start: int) -> tuple[int, int, int]:
    """Finish time of ``thread`` started at step ``start`` -> (finish, forks, unpaired promises/blocks)."""
    t, promised, running = start, deque(), []
    forks = unpaired = 0
    for step in thread.steps:
        if isinstance(step, Thread):
            unpaired += not promised
            begin = promised.popleft() if promised else t
            end, sub_forks, sub_unpaired = _finish(step, begin)
            running.append(end)
            forks, unpaired = forks + 1 + sub_forks, unpaired + sub_unpaired
            continue
        kind, cost = step
        t += cost
        if kind == "promise":
            promised.append(t)
        elif kind == "sync":
            t, running = max([t, *running]), []
    return max([t, *running]), forks, unpaired + len(promised)
