"""Planned Diffusion's demonstrations of Pasta's summed-chains task (``tasks.pasta``): each chain an independent
span, planned autoregressively, written by diffusion, then the sum after the sync (``core.planned_diffusion``)::

    prompt:     A=4 a+1 b-1 c+1
                B=7 d-1 e+1
                A+B=?
    annotated:  <think>
                <promise topic="A" tokens="2"/><promise topic="B" tokens="2"/><sync/>... (as the model writes it)
    flattened:  <think>
                <promise topic="A" tokens="2"/><promise topic="B" tokens="2"/><async>A=4 a+1=5 b-1=4 c+1=5 A:5
                <null> x 9</async><async>B=7 d-1=6 e+1=7 B:7
                <null> x 15</async><sync/>A:5+B:7=12
                </think>
                Answer: \\boxed{12}

The *flattened* response is the demonstration (what the runtime outputs and the learner trains on): a span's
body is its chain's line, then ``<null>`` up to ``UNIT · N`` tokens, ``N = ceil(line tokens / UNIT)``, counted
by ``count_tokens`` (default: the byte-level count, exact for the project's tokenizer, the lines having no tags).
The chains a problem forks (``PastaTask.forked``: all with ``fork_prob`` 1) are planned in rounds of consecutive
forked chains; a chain not forked is a plain line where it stands, so ``fork_prob`` < 1 alternates planning,
spans, sync and plain text. ``PlannedDiffusionTask`` writes Pasta's problems (the same for the same settings and
seed) with three reference solutions: ``solution`` (the flattened Planned Diffusion response), ``solution_pasta``
(Pasta-Lang's) and ``solution_plain`` (no annotations) — one problem set for the autoregressive, Pasta and PD
models of a comparison.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from sliderl.tasks.pasta import SYNC, Chain, PastaTask, byte_level_tokens, chain_line, combination, total

UNIT = 10  # = core.planned_diffusion's: tokens="N" plans UNIT·N body tokens
ASYNC_OPEN, ASYNC_CLOSE, NULL = "<async>", "</async>", "<null>"  # = core.planned_diffusion's (tasks has no torch)


def span_units(line: str, count_tokens: Callable[[str], int] = byte_level_tokens) -> int:
    """``N`` of the plan item for ``line``: ``ceil(tokens / UNIT)``."""
    return math.ceil(count_tokens(line) / UNIT)


def format_round(chains: list[Chain], count_tokens: Callable[[str], int] = byte_level_tokens) -> str:
    """One round: a promise per chain, each chain's span (its line padded with ``<null>``), the ``<sync/>``."""
    lines = [chain_line(c) for c in chains]
    units = [span_units(line, count_tokens) for line in lines]
    plan = "".join(f'<promise topic="{c[0]}" tokens="{n}"/>' for c, n in zip(chains, units))
    spans = "".join(f"{ASYNC_OPEN}{line}{NULL * (UNIT * n - count_tokens(line))}{ASYNC_CLOSE}"
                    for line, n in zip(lines, units))
    return plan + spans + SYNC


def format_planned(chains: list[Chain], count_tokens: Callable[[str], int] = byte_level_tokens,
                   forked: list[bool] | None = None) -> str:
    """The flattened Planned Diffusion response: rounds of consecutive forked chains (``forked``, default all),
    plain lines for the others, then the combination and the boxed answer."""
    forked = forked if forked is not None else [True] * len(chains)
    body, run = "", []
    for chain, fork in zip(chains, forked, strict=True):
        if fork:
            run.append(chain)
            continue
        body += (format_round(run, count_tokens) if run else "") + chain_line(chain)
        run = []
    body += format_round(run, count_tokens) if run else ""
    return f"<think>\n{body}{combination(chains)}</think>\nAnswer: \\boxed{{{total(chains)}}}"


class PlannedDiffusionTask(PastaTask):
    """Pasta's summed chains with Planned Diffusion's demonstrations (module docstring)."""

    def solutions(self, chains: list[Chain], prompt: str, count_tokens: Callable[[str], int]) -> dict[str, str]:
        """``solution`` (Planned Diffusion), ``solution_pasta`` (Pasta-Lang) and ``solution_plain``."""
        pasta = super().solutions(chains, prompt, count_tokens)
        planned = format_planned(chains, count_tokens, self.forked(prompt, len(chains)))
        return {"solution": planned, "solution_pasta": pasta["solution"], "solution_plain": pasta["solution_plain"]}
