"""Pasta's task in miniature: independent arithmetic chains summed at the end — a response with parallel
structure that a tiny model can learn to annotate in Pasta-Lang (thesis, Pasta chapter).

A problem gives K chains (named A, B, …), each a start value and signed operands, and asks for the
sum of their final values. Each chain is one fork; the main thread only promises them, waits at the
sync and adds the final values, which it sees once the forks are joined::

    prompt:     A=47 +5 -3 +8 -2 +7 +1 -9 +4
                B=23 +2 -1 +6 -4 +3 -2 +5 +1
                A+B=?
    annotated:  <think>
                <promise topic="A" tokens="6"/><async>A=47 +5=52 -3=49 +8=57 -2=55 +7=62 +1=63 -9=54 +4=58
                </async><promise topic="B" tokens="6"/><async>B=23 +2=25 -1=24 +6=30 -4=26 +3=29 -2=27 +5=32 +1=33
                </async><sync/>A+B=58+33=91
                </think>
                Answer: \\boxed{91}
    plain:      the same text without the five tags and the promises' attribute text (Baseline-SFT's target)

``tokens="N"`` is ``ceil(block tokens / UNIT)``, the block being ``<async>`` … ``</async>`` inclusive
(the fork's tokens, which the main thread's position ids skip), counted by ``count_tokens``: by
default ``byte_level_tokens``, exact for the project's byte-level tokenizer with the tags as special
tokens; pass a tokenizer's count to match another.

Sizes: a promise costs the main thread 23 byte-level tokens (``<promise``, `` topic="A" tokens="6"``,
``/>``) before its fork starts, so a fork pays only for a chain longer than that; a chain line of s
steps is 7 + 6s block tokens (two-digit values). With the default 8..12 steps the annotated
response's critical path is shorter than the plain response for every K in 2..4
(``tests/test_pasta_task.py`` measures it).

Splits are disjoint by a hash of the prompt and each split has its own random stream, as in
``rewards.arith``.
"""

from __future__ import annotations

import json
import math
import re
import string
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from rewards.arith import ArithVerifier, check_chain_bounds, draw_chain, is_eval_prompt, run_chain, split_rng
from rewards.math import END_THINK

ASYNC_OPEN, ASYNC_CLOSE, SYNC = "<async>", "</async>", "<sync/>"
PASTA_TAGS = ("<promise", "/>", ASYNC_OPEN, ASYNC_CLOSE, SYNC)  # = rollout.pasta.PASTA_TOKENS (rewards has no torch)
UNIT = 10  # = rollout.pasta.UNIT: tokens="N" predicts UNIT·N tokens
CHAIN_NAMES = string.ascii_uppercase

Chain = tuple[str, int, list[tuple[str, int]]]  # (name, start value, [(sign, operand)])

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

    num_chains: tuple[int, int] = (2, 4)
    """(fewest, most) chains K per problem, inclusive, in 2..26 (one letter per chain)."""
    num_steps: tuple[int, int] = (8, 12)
    """(fewest, most) steps per chain, inclusive (>= 1)."""
    max_operand: int = 9
    """Operands are drawn from 1..max_operand."""
    min_value: int = 10
    """Every chain's values lie in min_value..max_value (10..99: two digits each)."""
    max_value: int = 99
    """See min_value; max_value - min_value must be at least max_operand."""
    seed: int = 0
    """Problems are a pure function of (settings, seed, split, index)."""

    def __post_init__(self) -> None:
        lo, hi = self.num_chains
        if not 2 <= lo <= hi <= len(CHAIN_NAMES):
            raise ValueError(f"num_chains must be (a, b) with 2 <= a <= b <= {len(CHAIN_NAMES)}, got {self.num_chains}")
        if not 1 <= self.num_steps[0] <= self.num_steps[1]:
            raise ValueError(f"num_steps must be (a, b) with 1 <= a <= b, got {self.num_steps}")
        check_chain_bounds(self.max_operand, self.min_value, self.max_value)
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
            chains = [(name, *draw_chain(rng, self.num_steps, self.max_operand, self.min_value, self.max_value))
                      for name in CHAIN_NAMES[:rng.randint(*self.num_chains)]]
            prompt = format_prompt(chains)
            if is_eval_prompt(prompt) == (split == "eval"):
                records.append({"prompt_id": f"pasta-{split}-{len(records):06d}", "prompt": prompt,
                                "answer": str(total(chains)), "solution": format_annotated(chains, count_tokens),
                                "solution_plain": format_plain(chains)})
        return records

    def write_jsonl(self, path: str | Path, n: int, split: str = "train") -> Path:
        """Write ``problems(n, split)`` to ``path``, one JSON object per line; return the path."""
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("".join(json.dumps(r) + "\n" for r in self.problems(n, split)))
        return out


def format_prompt(chains: list[Chain]) -> str:
    """One ``A=47 +5 -3`` line per chain, then ``A+B=?``; each line ends with a newline."""
    lines = [f"{name}={start} " + " ".join(f"{sign}{operand}" for sign, operand in ops) for name, start, ops in chains]
    return "".join(line + "\n" for line in lines) + "+".join(name for name, _, _ in chains) + "=?\n"


def chain_line(chain: Chain) -> str:
    """``A=47 +5=52 -3=49`` and a newline: every step with the value it leads to."""
    name, start, ops = chain
    values = run_chain(start, ops)
    return f"{name}={start}" + "".join(f" {sign}{operand}={v}" for (sign, operand), v in zip(ops, values[1:])) + "\n"


def total(chains: list[Chain]) -> int:
    """The answer: the sum of the chains' final values."""
    return sum(run_chain(start, ops)[-1] for _, start, ops in chains)


def combination(chains: list[Chain]) -> str:
    """``A+B=58+33=91`` and a newline."""
    names = "+".join(name for name, _, _ in chains)
    finals = "+".join(str(run_chain(start, ops)[-1]) for _, start, ops in chains)
    return f"{names}={finals}={total(chains)}\n"


def format_plain(chains: list[Chain]) -> str:
    """The sequential response: every chain line, the combination, the boxed answer."""
    body = "".join(chain_line(c) for c in chains) + combination(chains)
    return f"<think>\n{body}{END_THINK}\nAnswer: \\boxed{{{total(chains)}}}"


def format_annotated(chains: list[Chain], count_tokens: Callable[[str], int] = byte_level_tokens) -> str:
    """The Pasta-Lang response: a promise and a block per chain, a sync, the combination, the boxed answer."""
    forks = ""
    for chain in chains:
        block = f"{ASYNC_OPEN}{chain_line(chain)}{ASYNC_CLOSE}"
        forks += f'<promise topic="{chain[0]}" tokens="{math.ceil(count_tokens(block) / UNIT)}"/>{block}'
    return f"<think>\n{forks}{SYNC}{combination(chains)}{END_THINK}\nAnswer: \\boxed{{{total(chains)}}}"


class PastaTaskVerifier(ArithVerifier):
    """Exact integer match of the last ``\\boxed{}`` after ``</think>`` (the arith verifier's rule); the tags
    all come before ``</think>``, so annotated and plain responses are read alike."""
