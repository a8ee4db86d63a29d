"""Rewards against real MATH-500 solutions and hand-worked values."""

import json
import pickle
import threading
from pathlib import Path

import pytest

from sliderl.rewards import (
    CorrectnessTerm,
    KVPenalty,
    KVPenaltyTerm,
    MathReward,
    RewardInput,
    RewardRecord,
    RewardSpec,
    ThinkingPenalty,
    ThinkingPenaltyTerm,
)
from sliderl.rewards.math import last_boxed

MATH500 = Path(__file__).resolve().parents[2] / "shared" / "data" / "math500-dev.jsonl"  # ../shared beside the repo


@pytest.fixture(scope="module")
def math500():
    assert MATH500.exists(), f"{MATH500} is missing: the tests need ../shared/data beside the repository"
    return [json.loads(line) for line in MATH500.read_text().splitlines() if line.strip()]


# --------------------------------------------------------------------------- math correctness
# All 250 problems of the file (about 6 s for both tests on a 2-core CPU, so no subset).


def test_math_reward_accepts_reference_solutions(math500):
    reward = MathReward()
    scores = [reward(row["solution"], row["answer"]).total for row in math500]
    misses = [row["id"] for row, s in zip(math500, scores) if s != 1.0]
    assert len(misses) <= 0.01 * len(math500), f"rejected reference solutions: {misses}"
    assert reward.num_errors == 0 and reward.num_unparseable == 0


def test_math_reward_rejects_another_problems_answer(math500):
    reward = MathReward()
    pairs = [(row, math500[(i + 1) % len(math500)]) for i, row in enumerate(math500)]
    pairs = [(a, b) for a, b in pairs if a["answer"].strip() != b["answer"].strip()]
    false_accepts = [(a["id"], a["answer"], b["answer"]) for a, b in pairs if reward(b["solution"], a["answer"]).total]
    assert len(pairs) >= 240
    assert len(false_accepts) <= 0.01 * len(pairs), f"false accepts: {false_accepts}"


def test_unparseable_completions_score_zero_and_are_counted():
    reward = MathReward()
    for text in ["The answer is 5.", "so \\boxed{5", "\\boxed 5"]:
        record = reward(text, "5")
        assert record.total == 0.0 and record.parsed is None and record.info["unparseable"] == 1.0
    assert reward.num_unparseable == 3 and reward.num_errors == 0
    assert reward(None, "5").total == 0.0 and reward.num_errors == 1  # a failure scores 0, counted, no raise


def test_only_the_text_after_think_is_graded():
    reward = MathReward()
    text = "<think>first guess \\boxed{4}, no wait</think>Final: \\boxed{5}"
    assert reward(text, "5").total == 1.0
    assert reward(text, "4").total == 0.0
    assert reward("<think>\\boxed{4}</think>The answer is 4.", "4").total == 0.0  # nothing boxed after </think>
    assert reward("no think tags, \\boxed{\\frac{1}{2}}", "0.5").total == 1.0


def test_a_trace_cut_short_in_its_thinking_has_no_answer():
    # Catches (issue 37): a trace truncated before </think> whose thinking holds \boxed{52} was rewarded 1.0
    # (the whole text was read when </think> never came). The answer is read outside the thinking block only:
    # an opened and never closed block has none, for both verifiers; a text without a thinking block is read
    # whole. Planted with the old answer_section (all of the text when </think> is missing), the truncated
    # trace scores 1.0 and this fails.
    from sliderl.rewards.arith import ArithVerifier

    truncated = "<think>\nStart at 47.\na+5=52\nso \\boxed{52} maybe\nb-3=4"  # max_tokens hit mid-thinking
    closed = "<think>\nStart at 47.\na+5=52\n</think>\nAnswer: \\boxed{52}"
    for verifier in (ArithVerifier(), MathReward()):
        cut = verifier(truncated, "52")
        assert cut.total == 0.0 and cut.parsed is None and cut.info["unparseable"] == 1.0
        assert verifier(closed, "52").total == 1.0
        assert verifier("Answer: \\boxed{52}", "52").total == 1.0  # no thinking block: the whole text
    custom = CorrectnessTerm(end_think="</reason>").build("arith")
    assert custom("<reason>\\boxed{52}", "52").total == 0.0
    assert custom("<reason>x</reason>\\boxed{52}", "52").total == 1.0


def test_last_boxed_balances_braces():
    assert last_boxed("\\boxed{1} then \\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert last_boxed("\\boxed{\\{1, 2\\}} end") == "\\{1, 2\\}"
    assert last_boxed("\\fbox{ x^{2} }") == " x^{2} "
    assert last_boxed("\\boxed{1} and \\boxed{2") is None  # the last box is unfinished
    assert last_boxed("nothing here") is None


def test_math_reward_off_the_main_thread_and_after_a_timeout():
    reward = MathReward()
    results = []

    def grade():
        results.append(reward("\\boxed{\\dfrac{3}{6}}", "\\frac12").total)
        results.append(reward("\\boxed{7}", "8").total)

    worker = threading.Thread(target=grade)
    worker.start()
    worker.join()
    assert results == [1.0, 0.0] and reward.num_errors == 0
    pickle.loads(pickle.dumps(reward))  # the child pool stays behind (e.g. when shipped to an actor)

    reward._backstop_s = lambda: 0.0  # the next check cannot finish in time: scored 0, counted, child killed
    worker = threading.Thread(target=lambda: results.append(reward("\\boxed{\\pi}", "\\pi").total))
    worker.start()
    worker.join()
    assert results[-1] == 0.0 and reward.num_errors == 1 and reward._pool is None
    reward.close()


# --------------------------------------------------------------------------- penalties


def test_kv_penalty_is_the_relative_overshoot_of_the_budget():
    penalty = KVPenalty(budget=1000)
    assert penalty(800.0).total == 0.0
    assert penalty(1500.0).total == pytest.approx(-0.5)  # -(1500 - 1000) / 1000
    assert penalty.score(RewardInput("x", mean_visible_kv=3000.0)).total == pytest.approx(-2.0)  # -2000 / 1000
    with pytest.raises(ValueError, match="mean_visible_kv"):
        penalty.score(RewardInput("x"))
    with pytest.raises(ValueError, match="budget"):
        KVPenalty(budget=0)


def test_thinking_penalty_counts_tokens_before_think_end():
    penalty = ThinkingPenalty(budget=4)
    assert penalty("a b c d e f </think> the answer").total == pytest.approx(-0.5)  # 6 words: -(6 - 4) / 4
    assert penalty("a b c </think> x y z w v").total == 0.0  # 3 <= 4
    assert penalty(num_thinking_tokens=10).total == pytest.approx(-1.5)  # -(10 - 4) / 4
    assert penalty("a b c d e f g h").total == pytest.approx(-1.0)  # never ended: all 8 count


# Pasta's speedup (Baseline-SFT's length / the critical path of core.pasta.PastaLayout): tests/test_pasta_bonbon.py


# --------------------------------------------------------------------------- composite


def test_reward_spec_weights_terms_and_keeps_components():
    # Catches: a term's weight applied twice or not at all, or a component stored after weighting.
    spec = RewardSpec(kv_penalty=KVPenaltyTerm(budget=1000, weight=2.0),
                      thinking_penalty=ThinkingPenaltyTerm(budget=1, weight=0.1))
    reward = spec.build("math")
    record = reward(RewardInput("<think>a b c</think> so \\boxed{42}", answer="42", mean_visible_kv=1500.0))
    # 1.0 * 1 + 2.0 * (-500 / 1000) + 0.1 * (-(3 - 1) / 1) (three words of thinking) = 1 - 1.0 - 0.2 = -0.2
    assert record.total == pytest.approx(-0.2)
    assert record.components == pytest.approx({"correctness": 1.0, "kv_penalty": -0.5, "thinking_penalty": -2.0})
    assert record.parsed == "42"
    metrics = record.as_metrics("train/reward")
    assert metrics["train/reward/total"] == pytest.approx(-0.2)
    assert metrics["train/reward/kv_penalty"] == pytest.approx(-0.5)
    assert metrics["train/reward/kv_penalty/mean_visible_kv"] == 1500.0
    assert all(isinstance(v, float) for v in metrics.values())


def test_reward_spec_picks_the_tasks_verifier():
    # Catches: the arith task scored by math_verify (or math by exact integers): "\\boxed{1/2}" is
    # right for math's answer 0.5 and not an integer for arith.
    text = "<think>x</think> \\boxed{1/2}"
    assert RewardSpec().build("math")(RewardInput(text, answer="0.5")).total == 1.0
    assert RewardSpec().build("arith")(RewardInput(text, answer="0")).total == 0.0
    assert RewardSpec(correctness=CorrectnessTerm(weight=3.0)).build("arith")(
        RewardInput("</think> \\boxed{7}", answer="7")).total == 3.0


def test_reward_term_errors_name_the_bad_value():
    # Catches: a bad option accepted by the record and failing later inside a rollout worker.
    with pytest.raises(ValueError, match="budget must be > 0, got -1"):
        KVPenaltyTerm(budget=-1)
    with pytest.raises(ValueError, match="timeout_s must be a whole number of seconds >= 1"):
        CorrectnessTerm(timeout_s=0)
    with pytest.raises(ValueError, match="at least one term"):
        RewardSpec(correctness=None)


def test_record_metrics_prefix():
    record = RewardRecord(0.5, {"a": 0.5}, info={"n": 2})
    assert record.as_metrics() == {"reward/total": 0.5, "reward/a": 0.5, "reward/n": 2.0}
