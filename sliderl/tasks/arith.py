"""The project's own task: multi-step arithmetic whose chain of steps outgrows the KV window.

A problem names a start value and a list of lettered operations; the reference solution restates
the start value, then writes one line per step (its letter, its operation, the new value) and
boxes the final value::

    prompt:   Start at 47. Apply a+5 b-3 c+8 d-2 e+7 f+1 g-9 h+4.
    solution: <think>
              47
              a+5=52
              b-3=49
              ...
              h+4=53
              </think>
              Answer: \\boxed{53}

With byte-level tokens a step line is 7 tokens (every value has two digits by default), so a
window of 24 tokens holds the last three lines: the running value and the current step letter.
The operation of the next step is only in the prompt, looked up by its letter, and so is the
number of steps. Under ``prefix_sliding:W`` the prompt stays visible and the chain can be finished;
under ``sliding_window:W`` the prompt leaves each layer's window after the first few lines. An L-layer model
still reads L·(W - 1) positions back through its layers (46 at the default W = 24 and 2 layers), so the
operations a chain needs after that are unknowable: the last ones of an 8-12-step chain, none of a 4-step one.

With ``restate`` the chain's state lives in its last line rather than in the prompt: the first thinking line is
the start value followed by every operation (copied from the prompt), and each later line the running value
followed by the operations still to apply (``___`` in the place of each one done, so that every line has one width
and what a token depends on is always the same distance back), so a window that holds one line and the next can
finish the chain without the prompt. It is the control for Prefix Sliding against a plain sliding window (``docs/results.md``,
"Prefix Sliding vs sliding window")::

    solution: <think>
              47 a+5 b-3 c+8
              52 b-3 c+8 ___
              49 c+8 ___ ___
              57 ___ ___ ___
              </think>
              Answer: \\boxed{57}

With ``summary_lines`` > 0 a problem also carries ``solution_summary``, the demonstration for the ``summary:N:S``
restart baseline (``core.restart``): the same lines in segments of at most ``summary_lines`` step lines, each
ending in a summary tool call that holds the current value and the steps left, e.g. ``<tool_call>49 c..h</tool_call>``
(``<tool_call>53 done</tool_call>`` after the last step); each later segment starts its thinking afresh from that
value (its context is the prompt with ``Context: 49 c..h`` inserted), and the last one only answers, so that the
answer never needs more of a context than one value line::

    <think>\n47\na+5=52\nb-3=49\n<tool_call>49 c..h</tool_call><think>\n49\nc+8=57\n ... h+4=53\n
    <tool_call>53 done</tool_call><think>\n53\n</think>\nAnswer: \\boxed{53}

Every value stays in ``[min_value, max_value]``: each step's operand is drawn first, then its sign
among those that keep the value in range. Train and eval problems come from separate random
streams and a problem belongs to the eval split exactly when a hash of its prompt says so, so the
splits are disjoint whatever their sizes.
"""

from __future__ import annotations

import hashlib
import json
import random
import string
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from sliderl.core.vocab import END_THINK

SPLITS = ("train", "eval")
STEP_LABELS = string.ascii_lowercase  # one byte-level token per step label
EVAL_EVERY = 8  # a prompt whose hash is 0 modulo this belongs to the eval split


@dataclass(frozen=True)
class ArithTask:
    """Generator of multi-step arithmetic problems (see the module docstring for the format)."""

    __pydantic_config__: ClassVar[dict] = {"extra": "forbid", "use_attribute_docstrings": True}

    num_steps: tuple[int, int] = (8, 12)
    """(fewest, most) steps per problem, inclusive; at most 26 (one letter per step)."""
    max_operand: int = 9
    """Operands are drawn from 1..max_operand."""
    min_value: int = 10
    """The start value and every later value lie in min_value..max_value (10..99: two digits each)."""
    max_value: int = 99
    """See min_value; max_value - min_value must be at least max_operand."""
    seed: int = 0
    """Problems are a pure function of (settings, seed, split, index)."""
    summary_lines: int = 0
    """> 0: problems also carry ``solution_summary``, a summary tool call after every this many step lines (the
    ``summary:N:S`` demonstration); 0: no such solution."""
    restate: bool = False
    """True: each thinking line restates the running value and the operations left (``52 b-3 c+8 ___``), so the
    chain's state is in its last line; False: one ``a+5=52`` line per step, the operations only in the prompt."""
    summary_call: tuple[str, str] = ("<tool_call>", "</tool_call>")
    """The text before and after the summary in ``solution_summary``'s calls: the engine's summary_tool call
    (its open token and call prefix; its call suffix and close token)."""

    def __post_init__(self) -> None:
        lo, hi = self.num_steps
        if not 1 <= lo <= hi <= len(STEP_LABELS):
            raise ValueError(f"num_steps must be (a, b) with 1 <= a <= b <= {len(STEP_LABELS)}, got {self.num_steps}")
        check_chain_bounds(self.max_operand, self.min_value, self.max_value)
        object.__setattr__(self, "num_steps", (int(lo), int(hi)))
        if isinstance(self.summary_lines, bool) or not isinstance(self.summary_lines, int) or self.summary_lines < 0:
            raise ValueError(f"summary_lines must be an integer >= 0, got {self.summary_lines!r}")
        if not isinstance(self.restate, bool):
            raise ValueError(f"restate must be true or false, got {self.restate!r}")
        if self.restate and self.summary_lines:
            raise ValueError(f"restate and summary_lines={self.summary_lines} do not combine: the summary "
                             "demonstration is written for the one-line-per-step format; set one of them")
        object.__setattr__(self, "summary_call", tuple(self.summary_call))
        if len(self.summary_call) != 2 or not all(isinstance(t, str) and t for t in self.summary_call):
            raise ValueError(f"summary_call must be two non-empty texts (before, after the summary), "
                             f"got {self.summary_call!r}")

    def problems(self, n: int, split: str = "train") -> list[dict]:
        """The first ``n`` problems of ``split``: dicts ``{prompt_id, prompt, answer, solution}``.

        ``answer`` is the final value as a string; ``solution`` the reference completion (without
        the end-of-sequence token). The first n problems of a split never change with n.
        """
        rng = split_rng("arith", self.seed, split, n)
        records: list[dict] = []
        while len(records) < n:
            start, ops = draw_chain(rng, self.num_steps, self.max_operand, self.min_value, self.max_value)
            prompt = format_prompt(start, ops)
            if is_eval_prompt(prompt) == (split == "eval"):
                values = run_chain(start, ops)
                record = {"prompt_id": f"arith-{split}-{len(records):06d}", "prompt": prompt,
                          "answer": str(values[-1]),
                          "solution": (format_restated_solution if self.restate else format_solution)(start, ops)}
                if self.summary_lines:
                    record["solution_summary"] = format_summary_solution(start, ops, self.summary_lines,
                                                                         self.summary_call)
                records.append(record)
        return records

    def max_completion_chars(self) -> int:
        """An upper bound on the characters of any reference solution (tokens, for a byte-level tokenizer)."""
        digits = len(str(self.max_value))
        if self.restate:  # n + 1 lines of the value and n operations or pads (" b-3" each), and "\n"
            op = 1 + 1 + 1 + len(str(self.max_operand))
            n = self.num_steps[1]
            return len(format_restated_solution(0, [])) - 3 + digits + (n + 1) * (digits + op * n + 1)
        line = 1 + 1 + len(str(self.max_operand)) + 1 + digits + 1  # "a+5=52\n"
        return len(format_solution(0, [])) - 2 + 2 * digits + self.num_steps[1] * line

    def write_jsonl(self, path: str | Path, n: int, split: str = "train") -> Path:
        """Write ``problems(n, split)`` to ``path``, one JSON object per line; return the path."""
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("".join(json.dumps(r) + "\n" for r in self.problems(n, split)))
        return out


def format_prompt(start: int, ops: list[tuple[str, int]]) -> str:
    """``Start at 47. Apply a+5 b-3.`` followed by a newline."""
    steps = " ".join(f"{STEP_LABELS[i]}{sign}{operand}" for i, (sign, operand) in enumerate(ops))
    return f"Start at {start}. Apply {steps}.\n"


def format_solution(start: int, ops: list[tuple[str, int]]) -> str:
    """The reference completion: the start value, one ``a+5=52`` line per step, the boxed final value."""
    values = run_chain(start, ops)
    lines = [str(start)] + [f"{STEP_LABELS[i]}{sign}{operand}={values[i + 1]}" for i, (sign, operand) in enumerate(ops)]
    body = "".join(line + "\n" for line in lines)
    return f"<think>\n{body}{END_THINK}\nAnswer: \\boxed{{{values[-1]}}}"


def format_restated_solution(start: int, ops: list[tuple[str, int]]) -> str:
    """The ``restate`` completion: line i is the value after i steps, then the operations left, then ``___`` in the
    place of each operation done (``52 b-3 c+8 ___``), so every line has one width and each token sits one line
    (minus one operation) after what it is computed or copied from; then the boxed final value."""
    values = run_chain(start, ops)
    names = [f"{STEP_LABELS[i]}{sign}{operand}" for i, (sign, operand) in enumerate(ops)]
    pad = "_" * len(names[0]) if names else ""
    body = "".join(" ".join([str(values[i]), *names[i:], *[pad] * i]) + "\n" for i in range(len(ops) + 1))
    return f"<think>\n{body}{END_THINK}\nAnswer: \\boxed{{{values[-1]}}}"


def step_summary(value: int, done: int, num_steps: int) -> str:
    """The summary after ``done`` of ``num_steps`` steps: the current value and the steps left, ``49 c..h``
    (``53 done`` when none is left)."""
    if done == num_steps:
        return f"{value} done"
    return f"{value} {STEP_LABELS[done]}..{STEP_LABELS[num_steps - 1]}"


def format_summary_solution(start: int, ops: list[tuple[str, int]], lines_per_segment: int,
                            call: tuple[str, str] = ("<tool_call>", "</tool_call>")) -> str:
    """``format_solution`` in segments of at most ``lines_per_segment`` step lines, each closed by a summary call
    ``call[0] + step_summary + call[1]``; each later segment restarts its thinking from the value; the last answers."""
    values = run_chain(start, ops)
    lines = [f"{STEP_LABELS[i]}{sign}{operand}={values[i + 1]}\n" for i, (sign, operand) in enumerate(ops)]
    out = ""
    for done in range(0, len(ops), lines_per_segment):
        end = min(done + lines_per_segment, len(ops))
        out += f"<think>\n{values[done]}\n" + "".join(lines[done:end])
        out += call[0] + step_summary(values[end], end, len(ops)) + call[1]
    return f"{out}<think>\n{values[-1]}\n{END_THINK}\nAnswer: \\boxed{{{values[-1]}}}"


def check_chain_bounds(max_operand: int, min_value: int, max_value: int) -> None:
    """The operand and value ranges ``draw_chain`` needs: a ValueError naming the bad setting otherwise."""
    if max_operand < 1:
        raise ValueError(f"max_operand must be >= 1, got {max_operand}")
    if min_value < 0 or max_value - min_value < max_operand:
        raise ValueError(f"need 0 <= min_value and max_value - min_value >= max_operand ({max_operand}), "
                         f"got min_value={min_value}, max_value={max_value}")


def draw_chain(rng: random.Random, num_steps: tuple[int, int], max_operand: int, min_value: int,
               max_value: int) -> tuple[int, list[tuple[str, int]]]:
    """A start value and ``[(sign, operand)]`` of ``num_steps`` (fewest, most) steps keeping every value in
    ``min_value..max_value``: each operand is drawn from 1..max_operand, then a sign that keeps it in range."""
    value = rng.randint(min_value, max_value)
    start, ops = value, []
    for _ in range(rng.randint(*num_steps)):
        operand = rng.randint(1, max_operand)
        signs = [s for s, v in (("+", value + operand), ("-", value - operand)) if min_value <= v <= max_value]
        sign = rng.choice(signs)
        value = value + operand if sign == "+" else value - operand
        ops.append((sign, operand))
    return start, ops


def run_chain(start: int, ops: list[tuple[str, int]]) -> list[int]:
    """``[start, value after step 1, ..., final value]``."""
    values = [start]
    for sign, operand in ops:
        values.append(values[-1] + operand if sign == "+" else values[-1] - operand)
    return values


def split_rng(task: str, seed: int, split: str, n: int) -> random.Random:
    """The random stream of ``task``'s ``split`` (a pure function of the arguments), after checking the
    request for ``n`` problems of it."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; valid: {', '.join(SPLITS)}")
    if n < 0:
        raise ValueError(f"number of problems must be >= 0, got {n}")
    return random.Random(f"{task}:{seed}:{split}")


def is_eval_prompt(prompt: str) -> bool:
    """True when ``prompt`` belongs to the eval split (a stable hash, the same in every process)."""
    digest = hashlib.sha256(prompt.encode()).digest()
    return int.from_bytes(digest[:4], "big") % EVAL_EVERY == 0
