"""Rewards against real MATH-500 solutions and hand-worked values."""

import json
import pickle
import threading
from pathlib import Path

import pytest

from rewards import CompositeReward, KVPenalty, MathReward, RewardInput, RewardRecord, SpeedupReward, ThinkingPenalty
from rewards.math import last_boxed
from rewards.pasta_lang import schedule

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
    penalty = KVPenalty(budget=1000, coef=0.5)
    assert penalty(800.0).total == 0.0
    assert penalty(1500.0).total == pytest.approx(-0.25)  # -0.5 * (1500 - 1000) / 1000
    assert penalty.score(RewardInput("x", mean_visible_kv=3000.0)).total == pytest.approx(-1.0)  # -0.5 * 2000 / 1000
    with pytest.raises(ValueError, match="mean_visible_kv"):
        penalty.score(RewardInput("x"))
    with pytest.raises(ValueError, match="budget"):
        KVPenalty(budget=0)


def test_thinking_penalty_counts_tokens_before_think_end():
    penalty = ThinkingPenalty(budget=4, coef=1.0)
    assert penalty("a b c d e f </think> the answer").total == pytest.approx(-0.5)  # 6 words: -(6 - 4) / 4
    assert penalty("a b c </think> x y z w v").total == 0.0  # 3 <= 4
    assert penalty(num_thinking_tokens=10).total == pytest.approx(-1.5)  # -(10 - 4) / 4
    assert penalty("a b c d e f g h").total == pytest.approx(-1.0)  # never ended: all 8 count


# --------------------------------------------------------------------------- Pasta speedup
# Whitespace tokens; a tag costs its own word count (<promise topic="..."/> is 2, the others 1).


def test_speedup_of_a_plain_response_is_one():
    record = SpeedupReward()("one two three")
    assert record.total == 1.0 and record.info["critical_path"] == 3.0
    assert SpeedupReward()("").total == 1.0


TWO_FORKS = (
    'Find the distance <promise topic="coords"/> <promise topic="formula"/> '
    "<async> A is (1,2) and B is (4,6) </async> "
    "<async> d equals root of dx squared plus dy squared </async> "
    "meanwhile <sync/> so d is 5"
)


def test_speedup_of_two_forks_by_hand():
    # main: "Find the distance" t=3; promise 1 t=5 (fork 1 starts); promise 2 t=7 (fork 2 starts)
    # fork 1: <async> + 7 words + </async> = 9 -> ends 5 + 9 = 14
    # fork 2: <async> + 9 words + </async> = 11 -> ends 7 + 11 = 18
    # main: "meanwhile" t=8; <sync/> t=9, waits -> max(9, 14, 18) = 18; "so d is 5" -> 22
    # tokens: 3 + 2 + 2 + 9 + 11 + 1 + 1 + 4 = 33 -> speedup 33 / 22 = 1.5
    # control tokens: 2 + 2 + 2 + 2 + 1 = 9 -> parallelism (33 - 9) / 22
    record = SpeedupReward()(TWO_FORKS)
    assert record.info["critical_path"] == 22.0 and record.info["num_tokens"] == 33.0
    assert record.total == pytest.approx(1.5)
    assert record.info["parallelism"] == pytest.approx(24 / 22)
    assert record.info["num_forks"] == 2.0 and record.info["num_malformed"] == 0.0


def test_speedup_of_nested_forks_by_hand():
    text = "a <promise/> <async> b <promise/> <async> c d e f </async> g <sync/> </async> h <sync/> i"
    # main: a t=1; promise t=2 -> fork F starts at 2
    # F: <async> 3; b 4; promise 5 -> fork G starts at 5; G: <async> 6, c d e f 10, </async> 11
    # F: g 6; <sync/> 7 -> max(7, 11) = 11; </async> 12 -> F ends 12
    # main: h 3; <sync/> 4 -> max(4, 12) = 12; i 13
    # tokens: a, promise, async, b, promise, async, c d e f, /async, g, sync, /async, h, sync, i = 17
    plan = schedule(text)
    assert (plan.critical_path, plan.num_tokens, plan.num_forks, plan.num_malformed) == (13, 17, 2, 0)
    assert plan.speedup == pytest.approx(17 / 13)


def test_malformed_pasta_is_scored_leniently_and_counted():
    # a block with no promise forks where it stands; an unclosed block closes at the end
    plan = schedule("x <async> y z </async> w <sync/> v <promise/> <async> u")
    # main: x 1; block forks at 1: <async> y z </async> = 4 -> ends 5; w 2; <sync/> 3 -> 5; v 6; promise 7
    # second block starts at 7: <async> u = 2 -> ends 9; end of text joins -> 9
    assert plan.critical_path == 9 and plan.num_malformed == 2
    assert schedule("a </async> b").num_malformed == 1  # stray close: a plain token
    deep = schedule("<async> " * 5000)  # degenerate output: nesting is capped, nothing recurses 5000 deep
    assert deep.num_tokens == 5000 and deep.num_malformed > 0


# --------------------------------------------------------------------------- composite


def test_composite_weights_terms_and_keeps_components():
    reward = CompositeReward.from_config(
        {
            "correctness": 1.0,
            "kv_penalty": {"budget": 1000, "coef": 0.5, "weight": 2.0},
            "latency": {"type": "speedup", "weight": 0.1},
        }
    )
    record = reward(RewardInput("<think>hmm</think> so \\boxed{42}", answer="42", mean_visible_kv=1500.0))
    # 1.0 * 1 + 2.0 * (-0.5 * 500 / 1000) + 0.1 * 1.0 (no Pasta tags) = 1 - 0.5 + 0.1 = 0.6
    assert record.total == pytest.approx(0.6)
    assert record.components == pytest.approx({"correctness": 1.0, "kv_penalty": -0.25, "latency": 1.0})
    assert record.parsed == "42"
    metrics = record.as_metrics("train/reward")
    assert metrics["train/reward/total"] == pytest.approx(0.6)
    assert metrics["train/reward/kv_penalty"] == pytest.approx(-0.25)
    assert metrics["train/reward/kv_penalty/mean_visible_kv"] == 1500.0
    assert all(isinstance(v, float) for v in metrics.values())


def test_composite_config_errors_name_the_bad_value():
    with pytest.raises(ValueError, match="unknown reward 'acc'.*correctness"):
        CompositeReward.from_config({"acc": 1.0})
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['budgt'\]"):
        CompositeReward.from_config({"kv_penalty": {"budgt": 100}})
    with pytest.raises(ValueError, match="budget must be > 0"):
        CompositeReward.from_config({"kv_penalty": {"budget": -1}})


def test_record_metrics_prefix():
    record = RewardRecord(0.5, {"a": 0.5}, info={"n": 2})
    assert record.as_metrics() == {"reward/total": 0.5, "reward/a": 0.5, "reward/n": 2.0}
