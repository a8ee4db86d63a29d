"""The generated tasks' verifier: exact integer match of the final boxed answer (``sliderl.tasks``)."""

from __future__ import annotations

from sliderl.core.vocab import END_THINK
from sliderl.rewards.math import answer_section, last_boxed
from sliderl.rewards.record import RewardInput, RewardRecord


class ArithVerifier:
    """1.0 when the last ``\\boxed{}`` after ``</think>`` holds the reference integer, else 0.0 (a thinking block
    opened and never closed has no answer).

    Exact integer match (``\\boxed{ 053 }`` counts as 53); the verifier of every generated task (arith,
    regmachine, pasta: Pasta's tags all come before ``</think>``, so annotated and plain responses read
    alike). Never raises: a completion with no box,
    or a box that is not an integer, scores 0 and is counted in ``num_unparseable``.
    """

    name = "correctness"

    def __init__(self, end_think: str = END_THINK):
        self.end_think = end_think
        self.num_calls = 0
        self.num_unparseable = 0

    def __call__(self, completion_text: str, answer: str | int) -> RewardRecord:
        self.num_calls += 1
        answer_text = answer_section(str(completion_text), self.end_think)
        boxed = last_boxed(answer_text) if answer_text is not None else None
        value = parse_int(boxed)
        if value is None:
            self.num_unparseable += 1
            return RewardRecord(0.0, {self.name: 0.0}, boxed, {"unparseable": 1.0})
        total = 1.0 if value == parse_int(str(answer)) else 0.0
        return RewardRecord(total, {self.name: total}, str(value), {"unparseable": 0.0})

    def score(self, sample: RewardInput) -> RewardRecord:
        if sample.answer is None:
            raise ValueError("ArithVerifier needs the task's reference answer; RewardInput.answer is None")
        return self(sample.completion_text, sample.answer)


def parse_int(text: str | None) -> int | None:
    """``text`` as an integer (surrounding spaces allowed), else None."""
    if text is None:
        return None
    stripped = text.strip()
    body = stripped[1:] if stripped[:1] in "+-" else stripped
    return int(stripped) if body.isdigit() and body.isascii() else None
