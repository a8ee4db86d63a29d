"""Final-answer correctness for math: the last ``\\boxed{...}`` after ``</think>`` (outside the thinking block only),
checked with math_verify.

math_verify bounds its sympy work with ``signal.alarm``, which only works in the main thread of a
process. ``MathReward`` therefore verifies in place when called from the main thread, and from any
other thread (a Ray actor's worker thread, a thread pool) sends the check to a single spawned child
process whose main thread can use the alarm; a child that overruns a backstop timeout is killed and
replaced. Either way a call never raises and never hangs.
"""

from __future__ import annotations

import logging
import multiprocessing
import threading
import weakref

from sliderl.core.vocab import END_THINK
from sliderl.rewards.record import RewardInput, RewardRecord

BOX_COMMANDS = ("\\boxed", "\\fbox")

logger = logging.getLogger(__name__)


def answer_section(text: str, end_think: str = END_THINK) -> str | None:
    """The text after the last end-of-thinking marker; all of it when no thinking block was opened; None when
    one was opened (``<think>`` for ``</think>``) and never closed: a trace cut short in its thinking has no
    answer, whatever ``\\boxed{}`` its thinking holds."""
    if end_think in text:
        return text.rpartition(end_think)[2]
    start = thinking_start(end_think)
    return None if start is not None and start in text else text


def thinking_start(end_think: str) -> str | None:
    """The marker that opens the thinking block ``end_think`` closes (``</think>`` -> ``<think>``), or None."""
    return "<" + end_think[2:] if end_think.startswith("</") and len(end_think) > 3 else None


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) with balanced braces, else None.

    ``\\{`` and ``\\}`` inside count as literal braces. A last box that never closes (a truncated
    completion) gives None rather than an earlier box.
    """
    start = max(text.rfind(cmd) for cmd in BOX_COMMANDS)
    if start < 0:
        return None
    cmd_end = start + 1
    while cmd_end < len(text) and text[cmd_end].isalpha():
        cmd_end += 1
    open_at = cmd_end
    while open_at < len(text) and text[open_at].isspace():
        open_at += 1
    if open_at >= len(text) or text[open_at] != "{":
        return None
    return _braced(text, open_at)


def _braced(text: str, open_at: int) -> str | None:
    """text[open_at] == '{' -> the content up to its matching '}', or None when unbalanced."""
    depth, i = 0, open_at
    while i < len(text):
        ch = text[i]
        if ch == "\\":
            i += 2  # an escaped character, e.g. \{ or \}
            continue
        depth += ch == "{"
        depth -= ch == "}"
        if depth == 0:
            return text[open_at + 1 : i]
        i += 1
    return None


def verify_boxed(prediction: str, answer: str, timeout_s: int) -> bool:
    """math_verify equivalence of a boxed prediction and a reference answer (both wrapped in \\boxed{})."""
    from math_verify import parse, verify
    from math_verify.errors import TimeoutException  # a BaseException: turn it into an ordinary error

    try:
        gold = parse(f"\\boxed{{{answer}}}", parsing_timeout=timeout_s)
        pred = parse(f"\\boxed{{{prediction}}}", parsing_timeout=timeout_s)
        return bool(gold) and bool(pred) and bool(verify(gold, pred, timeout_seconds=timeout_s))
    except TimeoutException as exc:
        raise TimeoutError(f"math_verify ran past {timeout_s} s") from exc


class MathReward:
    """1.0 when the last boxed answer (after ``</think>``; none while the thinking is open) equals the reference,
    else 0.0.

    Never raises: no box counts in ``num_unparseable``, any failure (exception, timeout) in
    ``num_errors``; both score 0. ``timeout_s`` bounds each math_verify parse/compare step.
    """

    name = "correctness"

    def __init__(self, timeout_s: int = 5, end_think: str = END_THINK):
        if timeout_s < 1:
            raise ValueError(f"timeout_s must be a whole number of seconds >= 1, got {timeout_s}")
        self.timeout_s = int(timeout_s)
        self.end_think = end_think
        self.num_calls = 0
        self.num_unparseable = 0
        self.num_errors = 0
        self._pool = None  # spawned child for calls off the main thread, created on demand

    def __call__(self, completion_text: str, answer: str) -> RewardRecord:
        self.num_calls += 1
        boxed = None
        try:
            answer_text = answer_section(completion_text, self.end_think)
            boxed = last_boxed(answer_text) if answer_text is not None else None
            if boxed is None:
                self.num_unparseable += 1
                return self._record(0.0, None, unparseable=1.0)
            return self._record(float(self._verify(boxed, str(answer))), boxed)
        except Exception as exc:  # any failure is a wrong answer, counted
            self.num_errors += 1
            logger.warning("math verification failed (%s: %s); scoring 0", type(exc).__name__, exc)
            return self._record(0.0, boxed, error=1.0)

    def score(self, sample: RewardInput) -> RewardRecord:
        if sample.answer is None:
            raise ValueError("MathReward needs the task's reference answer; RewardInput.answer is None")
        return self(sample.completion_text, sample.answer)

    def close(self) -> None:
        """Stop the verification child process, if one was started."""
        if self._pool is not None:
            self._pool.terminate()
            self._pool = None

    def _record(self, total: float, parsed: str | None, unparseable: float = 0.0, error: float = 0.0) -> RewardRecord:
        return RewardRecord(total, {self.name: total}, parsed, {"unparseable": unparseable, "verify_error": error})

    def _verify(self, boxed: str, answer: str) -> bool:
        if threading.current_thread() is threading.main_thread():
            return verify_boxed(boxed, answer, self.timeout_s)
        pending = self._child().apply_async(verify_boxed, (boxed, answer, self.timeout_s))
        try:
            return pending.get(timeout=self._backstop_s())
        except multiprocessing.TimeoutError:
            self.close()  # the child may be stuck in sympy: kill it, the next call starts a fresh one
            raise

    def _backstop_s(self) -> float:
        # two parses and one compare, each bounded by timeout_s in the child, plus a cold child's imports
        return 3 * self.timeout_s + 60.0

    def _child(self):
        if self._pool is None:
            self._pool = multiprocessing.get_context("spawn").Pool(processes=1)
            weakref.finalize(self, self._pool.terminate)
        return self._pool

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_pool"] = None  # a process pool does not travel (e.g. into a Ray actor)
        return state
