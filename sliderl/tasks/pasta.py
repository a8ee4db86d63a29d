"""Pasta's task in miniature: independent arithmetic chains summed at the end — a response with parallel
structure that a tiny model can learn to annotate in Pasta-Lang (thesis, Pasta chapter).

A problem gives K chains (named A, B, …), each a start value and lettered signed operands (the letters
run on across chains, one per step, so each step's operand is looked up in the prompt by a letter of its
own, as in ``tasks.arith``), and asks for the sum of their final values. A chain line ends with its final
value under its name (``A:55``); the sum copies each final by that name and adds them one at a time, so
every step a tiny model takes is a lookup by a unique key or a local addition. Each chain is one fork; the
main thread only promises them, waits at the sync and adds the final values, which it sees once the
forks are joined::

    prompt:     A=47 a+5 b-3 c+8 d-2
                B=23 e+2 f-1 g+6
                A+B=?
    annotated:  <think>
                <promise topic="A" tokens="4"/><async>A=47 a+5=52 b-3=49 c+8=57 d-2=55 A:55
                </async><promise topic="B" tokens="4"/><async>B=23 e+2=25 f-1=24 g+6=30 B:30
                </async><sync/>A:55+B:30=85
                </think>
                Answer: \\boxed{85}
    plain:      the same text without the tags and the promises' attribute text (Baseline-SFT's target)

With ``fork_prob`` < 1 each chain of the annotated response forks only with that chance and is otherwise a
plain line of the main thread where it stands (a sync follows when anything forked): the SFT data then
mixes both, and the SFT model samples parallelization choices for stage 2 (BoNBoN) to rank.

``tokens="N"`` is ``ceil(block tokens / UNIT)``, the block being ``<async>`` … ``</async>`` inclusive
(the fork's tokens, which the main thread's position ids skip), counted by ``count_tokens``: by
default ``byte_level_tokens``, exact for the project's byte-level tokenizer with the tags as special
tokens; pass a tokenizer's count to match another.

Sizes: a promise costs the main thread 22 byte-level tokens (``<promise``, `` topic="A" tokens="6"``,
``/>``) before its fork starts; a chain line of s steps is 10 + 7s tokens (two-digit values), its block
two more. Forking every chain but the last is the fastest layout (the last fork's block would follow
all the promises on the critical path). With the defaults (2..3 chains of 6..8 steps) the plain response
is ~160 tokens; over Baseline-style plain responses the geometric-mean theoretical speedup of the
annotated response is ~1.17 with every chain forked, ~1.06 at ``fork_prob`` 0.5 and ~1.34 forking all
but the last (``tests/test_pasta_task.py`` checks the fastest layout is shorter on every problem).

Splits are disjoint by a hash of the prompt and each split has its own random stream, as in
``tasks.arith``.
"""

from __future__ import annotations

import json
import math
import random
import re
import string
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from sliderl.core.vocab import END_THINK
from sliderl.tasks.arith import STEP_LABELS, check_chain_bounds, draw_chain, is_eval_prompt, run_chain, split_rng

ASYNC_OPEN, ASYNC_CLOSE, SYNC = "<async>", "</async>", "<sync/>"
PASTA_TAGS = ("<promise", "/>", ASYNC_OPEN, ASYNC_CLOSE, SYNC)  # = core.pasta.PASTA_TOKENS (rewards has no torch)
UNIT = 10  # = core.pasta.UNIT: tokens="N" predicts UNIT·N tokens
CHAIN_NAMES = string.ascii_uppercase

Chain = tuple[str, int, list[tuple[str, str, int]]]  # (name, start value, [(step label, sign, operand)])

_TAG = re.compile("|".join(re.escape(t) for t in sorted(PASTA_TAGS, key=len, reverse=True)))


def byte_level_tokens(text: str) -> int:
    """Tokens of ``text`` under the byte-level tokenizer with the Pasta-Lang tags as special tokens: one per
    tag, one per UTF-8 byte of the rest (exact for text without its other added tokens, such as
    ``<think>``; a fork's block has none)."""
    return len(_TAG.findall(text)) + len(_TAG.sub("", text).encode())


@dataclass(frozen=True)
class PastaTask:
    """Generator of summed-chains problems (see the module docstring for the format)."""

    __pydantic_config__: ClassVar[dict] = {"extra": "forbid", "use_attribute_docstrings": True}

    num_chains: tuple[int, int] = (2, 3)
    """(fewest, most) chains K per problem, inclusive, in 2..26 (one letter per chain)."""
    num_steps: tuple[int, int] = (6, 8)
    """(fewest, most) steps per chain, inclusive (>= 1); most chains x most steps <= 26 (one letter per step)."""
    max_operand: int = 9
    """Operands are drawn from 1..max_operand."""
    min_value: int = 10
    """Every chain's values lie in min_value..max_value (10..99: two digits each)."""
    max_value: int = 99
    """See min_value; max_value - min_value must be at least max_operand."""
    fork_prob: float = 1.0
    """Chance that a chain of the annotated solution is a fork; the others are plain lines of the main thread
    where they stand (the problems and the plain solution do not depend on it). 1: every chain forks; less
    mixes both in the Pasta-SFT data, so its model samples parallelization choices for stage 2 to rank."""
    seed: int = 0
    """Problems are a pure function of (settings, seed, split, index)."""

    def __post_init__(self) -> None:
        lo, hi = self.num_chains
        if not 2 <= lo <= hi <= len(CHAIN_NAMES):
            raise ValueError(f"num_chains must be (a, b) with 2 <= a <= b <= {len(CHAIN_NAMES)}, got {self.num_chains}")
        if not 1 <= self.num_steps[0] <= self.num_steps[1]:
            raise ValueError(f"num_steps must be (a, b) with 1 <= a <= b, got {self.num_steps}")
        if hi * self.num_steps[1] > len(STEP_LABELS):
            raise ValueError(f"num_chains {self.num_chains} x num_steps {self.num_steps} can need {hi * self.num_steps[1]} "
                             f"step letters; at most {len(STEP_LABELS)} (most chains x most steps <= 26)")
        check_chain_bounds(self.max_operand, self.min_value, self.max_value)
        if not 0 <= self.fork_prob <= 1:
            raise ValueError(f"fork_prob must be in [0, 1], got {self.fork_prob}")
        object.__setattr__(self, "num_chains", (int(lo), int(hi)))
        object.__setattr__(self, "num_steps", tuple(int(x) for x in self.num_steps))

    def problems(self, n: int, split: str = "train",
                 count_tokens: Callable[[str], int] = byte_level_tokens) -> list[dict]:
        """The first ``n`` problems of ``split``: dicts ``{prompt_id, prompt, answer, solution, solution_plain}``.

        ``solution`` is the Pasta-Lang-annotated response (Pasta-SFT's target; promises sized by
        ``count_tokens``), ``solution_plain`` the same content without annotations (Baseline-SFT's);
        both without the end-of-sequence token. The first n problems of a split never change with n.
        """
        rng = split_rng("pasta", self.seed, split, n)
        records: list[dict] = []
        while len(records) < n:
            chains = labelled([(name, *draw_chain(rng, self.num_steps, self.max_operand, self.min_value,
                                                  self.max_value)) for name in CHAIN_NAMES[:rng.randint(*self.num_chains)]])
            prompt = format_prompt(chains)
            if is_eval_prompt(prompt) == (split == "eval"):
                records.append({"prompt_id": f"pasta-{split}-{len(records):06d}", "prompt": prompt,
                                "answer": str(total(chains)), **self.solutions(chains, prompt, count_tokens)})
        return records

    def solutions(self, chains: list[Chain], prompt: str, count_tokens: Callable[[str], int]) -> dict[str, str]:
        """A problem's reference solutions by name: ``solution`` (Pasta-Lang) and ``solution_plain``."""
        forks = self.forked(prompt, len(chains))
        return {"solution": format_annotated(chains, count_tokens, forks), "solution_plain": format_plain(chains)}

    def forked(self, prompt: str, k: int) -> list[bool]:
        """Which of a problem's ``k`` chains the annotated solution forks: each with chance ``fork_prob``, from a
        stream of the prompt's own (so the problems themselves never depend on ``fork_prob``)."""
        if self.fork_prob >= 1:
            return [True] * k
        rng = random.Random(f"pasta-forks:{self.seed}:{prompt}")
        return [rng.random() < self.fork_prob for _ in range(k)]

    def write_jsonl(self, path: str | Path, n: int, split: str = "train") -> Path:
        """Write ``problems(n, split)`` to ``path``, one JSON object per line; return the path."""
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("".join(json.dumps(r) + "\n" for r in self.problems(n, split)))
        return out


def labelled(chains: list[tuple[str, int, list[tuple[str, int]]]]) -> list[Chain]:
    """Each step gets the next letter, running on across chains (a.. for A's steps, then B's, ...)."""
    out, at = [], 0
    for name, start, ops in chains:
        out.append((name, start, [(STEP_LABELS[at + j], sign, operand) for j, (sign, operand) in enumerate(ops)]))
        at += len(ops)
    return out


def values(chain: Chain) -> list[int]:
    """``[start, value after step 1, ..., final value]`` of one chain."""
    _, start, ops = chain
    return run_chain(start, [(sign, operand) for _, sign, operand in ops])


def format_prompt(chains: list[Chain]) -> str:
    """One ``A=47 a+5 b-3`` line per chain, then ``A+B=?``; each line ends with a newline."""
    lines = [f"{name}={start} " + " ".join(f"{label}{sign}{operand}" for label, sign, operand in ops)
             for name, start, ops in chains]
    return "".join(line + "\n" for line in lines) + "+".join(name for name, _, _ in chains) + "=?\n"


def chain_line(chain: Chain) -> str:
    """``A=47 a+5=52 b-3=49 A:49`` and a newline: every step with the value it leads to, then the final value
    under the chain's name (``A:``, which the combination copies)."""
    name, start, ops = chain
    steps = "".join(f" {label}{sign}{operand}={v}" for (label, sign, operand), v in zip(ops, values(chain)[1:]))
    return f"{name}={start}{steps} {name}:{values(chain)[-1]}\n"


def total(chains: list[Chain]) -> int:
    """The answer: the sum of the chains' final values."""
    return sum(values(chain)[-1] for chain in chains)


def combination(chains: list[Chain]) -> str:
    """``A:55+B:30=85+C:12=97`` and a newline: the final values copied by name, added one at a time."""
    (first, *rest), running = chains, values(chains[0])[-1]
    out = f"{first[0]}:{running}"
    for chain in rest:
        running += values(chain)[-1]
        out += f"+{chain[0]}:{values(chain)[-1]}={running}"
    return out + "\n"


def format_plain(chains: list[Chain]) -> str:
    """The sequential response: every chain line, the combination, the boxed answer."""
    body = "".join(chain_line(c) for c in chains) + combination(chains)
    return f"<think>\n{body}{END_THINK}\nAnswer: \\boxed{{{total(chains)}}}"


def format_annotated(chains: list[Chain], count_tokens: Callable[[str], int] = byte_level_tokens,
                     forked: list[bool] | None = None) -> str:
    """The Pasta-Lang response: a promise and a block per forked chain (``forked``, default all) or the plain
    line of a chain that is not, a sync when anything forked, the combination, the boxed answer."""
    body = ""
    for chain, fork in zip(chains, forked if forked is not None else [True] * len(chains), strict=True):
        if not fork:
            body += chain_line(chain)
            continue
        block = f"{ASYNC_OPEN}{chain_line(chain)}{ASYNC_CLOSE}"
        body += f'<promise topic="{chain[0]}" tokens="{math.ceil(count_tokens(block) / UNIT)}"/>{block}'
    sync = SYNC if forked is None or any(forked) else ""
    return f"<think>\n{body}{sync}{combination(chains)}{END_THINK}\nAnswer: \\boxed{{{total(chains)}}}"
