"""The arithmetic task and its verifier, against an independent re-parse and re-computation of each problem."""

import dataclasses
import itertools
import re
from pathlib import Path

import pytest
import yaml

from sliderl.core.kv_policy import KVPolicy
from sliderl.core.tiny import build_tokenizer
from sliderl.rewards import RewardInput
from sliderl.rewards.arith import ArithVerifier
from sliderl.tasks.arith import ArithTask

DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "tiny-arith.yaml"
SFT_CONFIG = DEFAULT_CONFIG.with_name("sft-tiny-arith.yaml")
PROMPT = re.compile(r"Start at (\d+)\. Apply ((?:[a-z][+-]\d+ ?)+)\.\n")
LINE = re.compile(r"([a-z])([+-])(\d+)=(\d+)")


def reparse(prompt: str) -> tuple[int, list[tuple[str, str, int]]]:
    """(start, [(letter, sign, operand)]) read back from the prompt text."""
    match = PROMPT.fullmatch(prompt)
    assert match, prompt
    ops = [(s[0], s[1], int(s[2:])) for s in match.group(2).split()]
    return int(match.group(1)), ops


def test_problems_are_deterministic_and_prefix_stable():
    task = ArithTask(num_steps=(8, 12), seed=3)
    assert task.problems(50, "train") == ArithTask(num_steps=(8, 12), seed=3).problems(50, "train")
    assert task.problems(20, "eval") == task.problems(40, "eval")[:20]
    assert task.problems(20) != ArithTask(num_steps=(8, 12), seed=4).problems(20)
    ids = [p["prompt_id"] for p in task.problems(50) + task.problems(50, "eval")]
    assert len(set(ids)) == len(ids)


def test_train_and_eval_splits_are_disjoint():
    task = ArithTask(num_steps=(8, 12))
    train = {p["prompt"] for p in task.problems(3000, "train")}
    evals = {p["prompt"] for p in task.problems(400, "eval")}
    assert len(train) == 3000 and len(evals) == 400  # no duplicates inside a split either
    assert not train & evals


def test_reference_solutions_follow_the_prompt_and_the_arithmetic():
    task = ArithTask(num_steps=(8, 16), max_operand=9, min_value=10, max_value=99, seed=1)
    for problem in task.problems(200) + task.problems(50, "eval"):
        start, ops = reparse(problem["prompt"])
        assert 8 <= len(ops) <= 16 and 10 <= start <= 99
        assert [letter for letter, _, _ in ops] == list("abcdefghijklmnop"[:len(ops)])
        value = start
        for sign, operand in [(s, o) for _, s, o in ops]:  # independent re-computation: Python's eval
            value = eval(f"{value}{sign}{operand}")
            assert 10 <= value <= 99 and 1 <= operand <= 9
        assert problem["answer"] == str(value)
        body, tail = problem["solution"].split("</think>")
        assert body.startswith(f"<think>\n{start}\n")  # the start value restated
        lines = LINE.findall(body)
        assert len(lines) == len(ops) == body.count("\n") - 2
        previous = start
        for (letter, sign, operand, result), op in zip(lines, ops):
            assert (letter, sign, int(operand)) == op  # the step names its letter and copies its operation
            assert int(result) == eval(f"{previous}{sign}{operand}")
            previous = int(result)
        assert tail == f"\nAnswer: \\boxed{{{value}}}"


def test_bad_settings_are_rejected():
    for kwargs in ({"num_steps": (0, 4)}, {"num_steps": (5, 4)}, {"num_steps": (8, 27)}, {"max_operand": 0},
                   {"max_value": 15}, {"min_value": -1}):
        with pytest.raises(ValueError, match=next(iter(kwargs))):
            ArithTask(**kwargs)
    with pytest.raises(ValueError, match="split"):
        ArithTask().problems(3, "test")


def test_verifier_scores_reference_solutions_one_and_wrong_answers_zero():
    verifier = ArithVerifier()
    problems = ArithTask().problems(100, "eval")
    assert all(verifier(p["solution"], p["answer"]).total == 1.0 for p in problems)
    wrong = [p["solution"].replace(f"{{{p['answer']}}}", f"{{{int(p['answer']) + 1}}}") for p in problems]
    assert all(verifier(w, p["answer"]).total == 0.0 for w, p in zip(wrong, problems))
    assert verifier.num_unparseable == 0 and verifier.num_calls == 200
    record = verifier.score(RewardInput(completion_text="</think>Answer: \\boxed{ 053 }", answer="53"))
    assert record.total == 1.0 and record.parsed == "53" and record.components == {"correctness": 1.0}


def test_verifier_counts_unparseable_answers_and_never_raises():
    verifier = ArithVerifier()
    texts = ["Answer: 37", "<think>\\boxed{37}</think>Answer: none", "\\boxed{thirty}", "\\boxed{3.5}",
             "\\boxed{37", "", None]
    records = [verifier(t, "37") for t in texts]
    assert [r.total for r in records] == [0.0] * len(texts)
    assert all(r.info["unparseable"] == 1.0 for r in records)
    assert verifier.num_unparseable == len(texts)
    assert verifier("no think tags \\boxed{37}", "37").total == 1.0


def test_default_config_chain_outgrows_the_window():
    """Under the default job's policy the last steps are generated after the prompt has left a
    plain sliding window, while the window still holds the previous step line (the running value)."""
    config = yaml.safe_load(DEFAULT_CONFIG.read_text())
    policy = KVPolicy.parse(config["engine"]["kv"])
    assert policy.kind == "prefix_sliding"
    fields = {f.name for f in dataclasses.fields(ArithTask)}
    task = ArithTask(**{k: v for k, v in config["task"].items() if k in fields})
    tokenizer = build_tokenizer()
    for problem in task.problems(200, "eval"):
        completion = problem["solution"]
        lines = completion.split("\n")[2:-2]  # the step lines
        longest_line = max(len(tokenizer(line + "\n").input_ids) for line in lines)
        assert policy.window >= 2 * longest_line
        last_line_start = len(tokenizer(completion.rpartition(lines[-1])[0]).input_ids)
        assert last_line_start >= policy.window  # the query writing the last step sees no prompt token


def test_restated_solutions_carry_the_whole_state_in_each_line():
    # Catches (issue 41, the Prefix Sliding vs sliding window control): a restated line that drops or reorders
    # the operations left, a value off by one step, or a variant whose state still lives only in the prompt.
    # Hand example: 47 a+5 -> 52, b-3 -> 49, c+8 -> 57.
    from sliderl.tasks.arith import format_restated_solution

    assert format_restated_solution(47, [("+", 5), ("-", 3), ("+", 8)]) == (
        "<think>\n47 a+5 b-3 c+8\n52 b-3 c+8 ___\n49 c+8 ___ ___\n57 ___ ___ ___\n</think>\nAnswer: \\boxed{57}")
    task = ArithTask(num_steps=(8, 8), restate=True)
    plain = ArithTask(num_steps=(8, 8))
    assert [p["prompt"] for p in task.problems(50)] == [p["prompt"] for p in plain.problems(50)]  # same problems
    for problem in task.problems(100) + task.problems(30, "eval"):
        start, ops = reparse(problem["prompt"])
        lines = problem["solution"].split("</think>")[0].split("\n")[1:-1]
        assert len(lines) == len(ops) + 1 and lines[0].split() == [str(start)] + [f"{l}{s}{o}" for l, s, o in ops]
        for before, after in itertools.pairwise(lines):  # each line follows from the previous line alone, one width
            value, first, *rest = before.split()
            assert after.split() == [str(eval(f"{value}{first[1:]}")), *rest, "___"] and len(after) == len(before)
        assert lines[-1].split() == [problem["answer"]] + ["___"] * len(ops)
    assert task.max_completion_chars() == max(len(p["solution"]) for p in task.problems(200))
    with pytest.raises(ValueError, match="restate"):
        ArithTask(restate=True, summary_lines=2)


def test_what_a_sliding_window_can_reach_in_each_variant_of_the_comparison():
    # The premises of benchmarks/ps_vs_sw.py, in tokens of the byte-level tokenizer, at W = 24 and the recipe's
    # 2 layers. The token at position p is predicted by the query at p - 1; under sliding_window:W one layer reads
    # keys up to W - 1 back, L layers up to L·(W - 1) = 46 back. Plain, 4 steps: the last step's operand, given in
    # the prompt, is within 46 (a 2-layer sliding window can in principle finish). Plain, 8 steps: it is beyond
    # (it cannot). Restated, 4 steps: each line's first operation copied from the prompt, and each line's value
    # from the previous line, within one window (W - 1). Catches a comparison whose sliding-window arm fails or
    # succeeds by construction where the writeup says otherwise (e.g. one layer's W taken for the reach).
    window, layers = 24, yaml.safe_load(SFT_CONFIG.read_text())["model"]["num_layers"]
    reach = layers * (window - 1)
    assert reach == 46
    tokenizer = build_tokenizer()
    ntok = lambda text: len(tokenizer(text).input_ids)  # noqa: E731
    for steps, restate in ((4, False), (8, False), (4, True)):
        for problem in ArithTask(num_steps=(steps, steps), restate=restate).problems(50, "eval"):
            prompt = problem["prompt"]
            lines = problem["solution"].split("</think>")[0].split("\n")[1:-1]
            if restate:
                first_op = ntok(prompt) + ntok("<think>\n" + lines[0].split(" ")[0] + " ")
                assert (first_op - 1) - ntok(prompt.split("Apply ")[0] + "Apply ") <= window - 1
                assert all(ntok(previous + "\n") <= window - 1 for previous in lines)
            else:  # the last step line "h+5=NN": its operand "5" and the prompt's "5" of "h+5.\n"
                operand = ntok(prompt) + ntok("<think>\n" + "\n".join(lines[:-1]) + "\n") + 2
                distance = (operand - 1) - (ntok(prompt) - 3)
                assert distance <= reach if steps == 4 else distance > reach, (steps, distance)
