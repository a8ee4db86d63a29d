"""TIP's task in miniature: a register machine whose reasoning steps really die.

A problem sets a few two-digit variables, changes the first one once (the *prologue*), runs a loop
body over the others, in order, a number of times (``3x``), and asks for the prologue variable at
the end (the answer is always ``a``; the prompt is kept short so that the trace's KV, not the
prompt's, dominates, as in long reasoning)::

    prompt:   a=61 b=47 c=23; a-4; 3x b+3 c-2
    solution: <think>
              a=61-4=57
              1 b=47+3=50
              1 c=23-2=21
              2 b=50+3=53
              2 c=21-2=19
              3 b=53+3=56
              3 c=19-2=17
              </think>
              Answer: \\boxed{57}

Every value has two digits and the variables always come in the same order, so every line has the
same width and a value is read at a fixed distance back (the loop variable's line one iteration
earlier, or its place in the prompt): a 2-layer model learns the task by position, as it learns
``tasks.arith``; with shuffled variables (a lookup by name) it did not learn it in 600 SFT steps.

Each line is a *step*: it restates the value it reads (its variable's latest value: the prompt's
or the last step that wrote it), applies the operation and writes the new value. A loop step
"i x=..." reads only the step of x from iteration i-1, so that step is **dead** from the next line
on; the prologue step is read only by the answer, so it must stay live to the end while the loop
runs. The loop is short in the prompt and long in the trace, so the trace's KV dwarfs the prompt's.

Dense traces are these lines as they are. Register traces (TIP) prefix every step with a thought
register ``<reg_i>``: emitting ``<reg_i>`` kills the step that held ``<reg_i>`` before (see
``core.kv_policy``). A schedule is *valid* when it kills a step only after its last reader. Two
valid schedules are generated:

- ``optimal``: every step kills a dead step when there is one (the oldest), so the live steps are
  the prologue, the latest step of every loop variable and the one just read: ``body + 2``.
- ``lazy`` (the SFT annotations): free registers are used in turn, and a dead step is killed only
  once a per-problem number of them (``lazy_registers - lazy_spread .. lazy_registers``) is held —
  live KV stays high, and reaching the optimum is the RL stage's work.

``tests/test_regmachine.py`` measures both against Dense under the engine's rule (live tokens averaged
over decode steps and at the end, byte-level tokens, the prompt included). With the defaults (12-16
loop repeats, ~580-token Dense traces, lazy annotations filling 6-32 of 32 registers) the lazy
schedule keeps about 72% of Dense's mean live KV (53% at the end), the optimal one about 31% (21%):
TIP's target of half of Dense's mean lies between them, so reaching it is the RL stage's work. (With
7-9 repeats the optimum itself was 48% of Dense's mean: the fill before the first kill weighs on a
short trace.)

With ``prologue=False`` the prompt has no prologue operation (``a=61 b=47 c=23; 3x b+3 c-2``) and the answer is
``a``'s initial value: a copy from the prompt that no trace line restates (issue 16's long traces, where only a
kept prompt prefix holds it).

Every value stays in ``[min_value, max_value]`` (two digits): a loop operation's operand and sign are
drawn first, then a start value from the range the whole loop keeps in bounds. Splits are disjoint by
a hash of the prompt, as in ``tasks.arith``.
"""

from __future__ import annotations

import json
import random
import string
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Literal

from sliderl.core.vocab import END_THINK
from sliderl.tasks.arith import is_eval_prompt, split_rng

VARIABLES = string.ascii_lowercase
SCHEDULES = ("dense", "lazy", "optimal")


@dataclass(frozen=True)
class Step:
    """One reasoning line: ``[iteration ]var=old±operand=new``; ``reads`` is the index of the step whose
    value it restates (-1: the prompt's initial value)."""

    iteration: int  # 0 for the prologue
    var: str
    old: int
    sign: str
    operand: int
    new: int
    reads: int

    def text(self, label_width: int = 1) -> str:
        label = "" if self.iteration == 0 else f"{self.iteration:0{label_width}d} "
        return f"{label}{self.var}={self.old}{self.sign}{self.operand}={self.new}\n"


@dataclass(frozen=True)
class Program:
    """A problem: initial values, the prologue operation, the loop body and count, the printed variable."""

    start: tuple[tuple[str, int], ...]
    prologue: tuple[str, str, int] | None  # (var, sign, operand); None: the printed variable is never written
    body: tuple[tuple[str, str, int], ...]
    repeats: int
    label_width: int = 1
    """Digits of every iteration label (zero-padded), so all loop lines have one width."""
    print_last: bool = False
    """The printed variable is the loop body's last one (its final value is the trace's last line), not the
    prologue's."""

    @property
    def printed(self) -> str:
        return self.body[-1][0] if self.print_last else self.start[0][0]

    def prompt(self) -> str:
        values = " ".join(f"{v}={x}" for v, x in self.start)
        prologue = "" if self.prologue is None else "{}{}{}; ".format(*self.prologue)
        body = " ".join(f"{v}{s}{o}" for v, s, o in self.body)
        return f"{values}; {prologue}{self.repeats}x {body}\n"

    def steps(self) -> list[Step]:
        """The reasoning steps in order, each pointing at the step it reads."""
        value = dict(self.start)
        writer = {v: -1 for v in value}
        steps: list[Step] = []
        ops = [(0, self.prologue)] if self.prologue is not None else []
        ops += [(i, op) for i in range(1, self.repeats + 1) for op in self.body]
        for iteration, (var, sign, k) in ops:
            new = value[var] + k if sign == "+" else value[var] - k
            steps.append(Step(iteration, var, value[var], sign, k, new, writer[var]))
            value[var], writer[var] = new, len(steps) - 1
        return steps

    def answer(self) -> int:
        written = [s for s in self.steps() if s.var == self.printed]
        return written[-1].new if written else dict(self.start)[self.printed]

    def last_readers(self) -> list[int]:
        """For each step, the index of the last step that reads it; ``len(steps)`` for the step the
        answer reads (live to the end), -1 for a step nothing reads."""
        steps = self.steps()
        last = [-1] * len(steps)
        for i, s in enumerate(steps):
            if s.reads >= 0:
                last[s.reads] = i
        written = [i for i, s in enumerate(steps) if s.var == self.printed]
        if written:  # without a prologue the answer reads the prompt, which no schedule kills
            last[written[-1]] = len(steps)
        return last


def register_schedule(program: Program, kind: str, lazy_registers: int) -> list[int]:
    """The register of every step under the ``optimal`` or ``lazy`` schedule (see the module docstring).

    A step at index t may kill step j only when ``last_readers[j] < t``: the kill takes effect at the
    step's register token, before the step reads anything.
    """
    if kind not in ("optimal", "lazy"):
        raise ValueError(f"unknown register schedule {kind!r}; valid: optimal, lazy")
    last = program.last_readers()
    holder: dict[int, int] = {}  # register -> step holding it
    registers = []
    for t in range(len(last)):
        dead = sorted((j, r) for r, j in holder.items() if last[j] < t)
        free = [r for r in range(lazy_registers) if r not in holder] if kind == "lazy" else []
        if free:
            reg = free[0]
        elif dead:
            reg = dead[0][1]  # the oldest dead step's register
        else:
            reg = next(r for r in range(len(last) + 1) if r not in holder)
            if kind == "lazy":
                raise ValueError(f"lazy_registers={lazy_registers} cannot hold this program's live steps "
                                 f"({len(holder)} live at step {t}); raise lazy_registers")
        holder[reg] = t
        registers.append(reg)
    return registers


def format_solution(program: Program, registers: list[int] | None = None) -> str:
    """The completion: ``<think>``, one line per step (prefixed by ``<reg_i>`` when ``registers`` is
    given), ``</think>``, the boxed answer."""
    steps = program.steps()
    prefix = [""] * len(steps) if registers is None else [f"<reg_{r}>" for r in registers]
    body = "".join(p + s.text(program.label_width) for p, s in zip(prefix, steps))
    return f"<think>\n{body}{END_THINK}\nAnswer: \\boxed{{{program.answer()}}}"


@dataclass(frozen=True)
class RegisterMachineTask:
    """Generator of register-machine problems (see the module docstring for the format)."""

    __pydantic_config__: ClassVar[dict] = {"extra": "forbid", "use_attribute_docstrings": True}

    num_variables: int = 4
    """Variables a, b, c, ...: one is the prologue's (and printed), the others run in the loop (>= 2)."""
    repeats: tuple[int, int] = (12, 16)
    """(fewest, most) loop iterations, inclusive, in 1..99; every iteration label has the digits of the
    most (``07 b=...`` when it is 16), so all loop lines have one width."""
    max_operand: int = 5
    """Operands are drawn from 1..max_operand."""
    min_value: int = 10
    """Every value lies in min_value..max_value."""
    max_value: int = 99
    """See min_value; the range must fit max_operand times the most repeats."""
    prologue: bool = True
    """False: no prologue operation, so the answer is the printed variable's initial value, a copy from the prompt
    that no line of the trace restates: under a window shorter than the trace only a kept prompt prefix holds it
    (issue 16's long traces; with the prologue the answer also needs its arithmetic, which a small model learns
    from far fewer of its rare answer tokens)."""
    num_registers: int = 32
    """Thought registers of the policy (registers:N) the annotations are written for."""
    lazy_registers: int = 32
    """Registers the lazy (SFT) schedule fills before it kills anything (<= num_registers); with
    ``lazy_spread``, the most of a range."""
    lazy_spread: int = 26
    """Each problem's lazy schedule fills a number of registers drawn from
    ``lazy_registers - lazy_spread .. lazy_registers`` (>= 0): annotations that are lazy by varying
    amounts, so the SFT model samples earlier kills now and then and RL can reinforce them."""
    answer: Literal["prologue", "last"] = "prologue"
    """The variable the problem asks for: ``prologue`` (the first, written once before the loop and read only by
    the answer, so its step must stay live through the whole loop) or ``last`` (the loop body's last variable,
    whose final value is the trace's last line: every step the answer needs is recent, so a recency window or an
    attention-mass budget that holds the last iteration can answer; the variant where eviction baselines can in
    principle succeed, issue 41). The prompt is the same; the model learns which one by position."""
    seed: int = 0
    """Problems are a pure function of (settings, seed, split, index)."""

    def __post_init__(self) -> None:
        lo, hi = self.repeats
        if not 1 <= lo <= hi <= 99:
            raise ValueError(f"repeats must be (a, b) with 1 <= a <= b <= 99, got {self.repeats}")
        if not 2 <= self.num_variables <= len(VARIABLES):
            raise ValueError(f"num_variables must be in 2..{len(VARIABLES)}, got {self.num_variables}")
        if self.max_operand < 1:
            raise ValueError(f"max_operand must be >= 1, got {self.max_operand}")
        if self.min_value < 0 or self.max_value - self.min_value < self.max_operand * hi:
            raise ValueError(f"max_value - min_value must be >= max_operand * most repeats "
                             f"({self.max_operand * hi}), got {self.min_value}..{self.max_value}")
        if not self.num_variables + 1 <= self.lazy_registers <= self.num_registers:
            raise ValueError(f"lazy_registers must be in {self.num_variables + 1}..num_registers "
                             f"({self.num_registers}) to hold the live steps, got {self.lazy_registers}")
        if not 0 <= self.lazy_spread <= self.lazy_registers - self.num_variables - 1:
            raise ValueError(f"lazy_spread must be in 0..lazy_registers - num_variables - 1 "
                             f"({self.lazy_registers - self.num_variables - 1}), got {self.lazy_spread}")
        object.__setattr__(self, "repeats", (int(lo), int(hi)))

    def program(self, rng: random.Random) -> Program:
        """One random program."""
        names = VARIABLES[:self.num_variables]
        kept = names[0]
        lo, hi = self.min_value, self.max_value
        repeats = rng.randint(*self.repeats)
        body, start = [], {}
        for v in names:
            if v == kept:
                continue
            k, sign = rng.randint(1, self.max_operand), rng.choice("+-")
            span = k * repeats
            start[v] = rng.randint(lo, hi - span) if sign == "+" else rng.randint(lo + span, hi)
            body.append((v, sign, k))
        start[kept] = rng.randint(lo, hi)
        k = rng.randint(1, self.max_operand)
        signs = [s for s, x in (("+", start[kept] + k), ("-", start[kept] - k)) if lo <= x <= hi]
        prologue = (kept, rng.choice(signs), k) if self.prologue else None
        return Program(tuple((v, start[v]) for v in names), prologue, tuple(body), repeats, len(str(self.repeats[1])),
                       self.answer == "last")

    def problems(self, n: int, split: str = "train") -> list[dict]:
        """The first ``n`` problems of ``split``: ``{prompt_id, prompt, answer, solution, solution_dense,
        solution_optimal}``; ``solution`` is the lazy register-annotated trace (the SFT target of a TIP
        model), ``solution_dense`` the same lines without registers (the Dense baseline's)."""
        rng = split_rng("regmachine", self.seed, split, n)
        records: list[dict] = []
        while len(records) < n:
            program = self.program(rng)
            lazy = self.lazy_registers - rng.randint(0, self.lazy_spread)
            prompt = program.prompt()
            if is_eval_prompt(prompt) != (split == "eval"):
                continue
            records.append({
                "prompt_id": f"regmachine-{split}-{len(records):06d}", "prompt": prompt, "answer": str(program.answer()),
                "solution": format_solution(program, register_schedule(program, "lazy", lazy)),
                "solution_dense": format_solution(program),
                "solution_optimal": format_solution(program, register_schedule(program, "optimal", self.lazy_registers)),
            })
        return records

    def max_completion_chars(self) -> int:
        """An upper bound on a solution's byte-level tokens (a register token counts one)."""
        steps = 1 + (self.num_variables - 1) * self.repeats[1]
        label = len(str(self.repeats[1])) + 1
        line = 1 + label + 2 + 2 + 1 + len(str(self.max_operand)) + 1 + 2 + 1  # "<reg>" "9 " "a=" "50" "+" "3" "=" "53" "\n"
        return len("<think>\n") + steps * line + len(f"{END_THINK}\nAnswer: \\boxed{{}}") + len(str(self.max_value))

    def write_jsonl(self, path: str | Path, n: int, split: str = "train") -> Path:
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("".join(json.dumps(r) + "\n" for r in self.problems(n, split)))
        return out
