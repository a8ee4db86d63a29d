"""The summed-chains task (tasks.pasta): annotated responses parse into K forks joined by one sync
with a shorter critical path than the plain response, the plain response is the annotated one without
annotations, answers verify, splits are disjoint and stable.

Independent references: the byte-level tokenizer itself (token counts), core.pasta's parser and a
text-level schedule written here (two separate implementations of the critical path), a regular
expression that strips the annotations, and arithmetic redone here from the prompt.
"""

from __future__ import annotations

import math
import re

import pytest

from sliderl.core import pasta
from sliderl.core.pasta import PastaLayout, PastaTokenIds
from sliderl.core.tiny import build_tokenizer
from sliderl.rewards.arith import ArithVerifier
from sliderl.tasks.pasta import PASTA_TAGS, UNIT, PastaTask, byte_level_tokens, format_annotated

TOKENIZER = build_tokenizer(extra_special_tokens=pasta.PASTA_TOKENS)
TAGS = PastaTokenIds.from_tokenizer(TOKENIZER)


def ids(text: str) -> list[int]:
    return TOKENIZER(text).input_ids


def problems() -> list[dict]:
    task = PastaTask()
    return task.problems(30) + task.problems(10, "eval")


# catches: the task's copies of the tag strings or the unit drifting from core.pasta's, and a token
# count that does not match the tokenizer the models use (planted: tags counted by their bytes -> fails).
def test_constants_and_token_count_agree_with_the_tokenizer():
    assert PASTA_TAGS == pasta.PASTA_TOKENS and UNIT == pasta.UNIT
    for p in problems()[:10]:
        blocks = re.findall(r"<async>.*?</async>", p["solution"], re.S)
        for text in (*blocks, p["prompt"]):
            assert byte_level_tokens(text) == len(ids(text))


def text_schedule(annotated: str) -> int:
    """Critical path of an annotated response from its text pieces: each token one step on its thread, a fork
    starting after its promise's "/>", the sync waiting for every fork (the rule of core.pasta, redone)."""
    pieces = re.split(r'(<promise[^<>]*/><async>.*?</async>|<sync/>)', annotated, flags=re.S)
    step, ends = 0, []
    for piece in pieces:
        if piece.startswith("<promise"):
            promise, block = piece.split("/>", 1)
            step += len(ids(promise + "/>"))
            ends.append(step + len(ids(block)))
        elif piece == "<sync/>":
            step = max([step + 1, *ends])
        else:
            step += len(ids(piece))
    return max([step, *ends])


# catches: a promise's tokens="N" that does not cover its block (planted: floor instead of ceil -> the
# main thread resumes inside the fork's positions), a sync that does not join every fork (planted: no
# sync), forks that are not the chains, layouts not faster than the plain response (planted: 3..5 steps
# per chain), the layout's critical path disagreeing with the text-level schedule (planted: main tokens
# after a block costing no step).
def test_annotated_responses_fork_each_chain_and_join_them_at_one_sync():
    for p in problems():
        k = p["prompt"].count("\n") - 1
        completion = ids(p["solution"])
        layout = PastaLayout.parse(3, completion, TAGS, TOKENIZER.decode)
        assert len(layout.forks) == k and 2 <= k <= 3 and layout.malformed.total == 0
        sync = [3 + j for j, t in enumerate(completion) if t == TAGS.sync]
        assert len(sync) == 1 and all(f.join == sync[0] for f in layout.forks)
        for f, name in zip(layout.forks, "ABCD"):
            block = completion[f.block[0] - 3:f.block[1] - 3]
            assert TOKENIZER.decode(block[1:-1]).startswith(f"{name}=")
            assert f.units == math.ceil(len(block) / 10)
            resume = int(layout.positions[f.fork_point]) + 1 + 10 * f.units  # the main thread after the block
            assert int(layout.positions[f.block[1] - 1]) < resume  # the fork fits its predicted length
        assert text_schedule(p["solution"]) == layout.critical_path
        plain = len(ids(p["solution_plain"]))
        assert layout.critical_path < plain or k == 2  # two chains: every fork's block follows both promises
    for task in (PastaTask(num_chains=(2, 2)), PastaTask(num_chains=(3, 3))):  # the fastest layout: all but the last
        for p in task.problems(40):
            chains = parsed_chains(p["prompt"])
            fastest = format_annotated(chains, forked=[True] * (len(chains) - 1) + [False])
            assert text_schedule(fastest) < len(ids(p["solution_plain"])) - 20


def parsed_chains(prompt: str) -> list:
    """The chains of a prompt, read back from its text (``A=47 a+5 b-3`` per line)."""
    chains = []
    for line in prompt.splitlines()[:-1]:
        head, *steps = line.split()
        chains.append((head[0], int(head[2:]), [(s[0], s[1], int(s[2:])) for s in steps]))
    return chains


# catches: fork_prob ignored (planted: every chain forked), the problems or the plain solution changing with
# it (the fork choices must come from a stream of their own), a sync written without any fork.
def test_fork_prob_mixes_forks_and_main_thread_lines():
    every, mixed, none = (PastaTask(fork_prob=f).problems(60) for f in (1.0, 0.5, 0.0))
    for a, b, c in zip(every, mixed, none):
        assert a["prompt"] == b["prompt"] == c["prompt"] and a["solution_plain"] == b["solution_plain"]
        assert "<sync/>" not in c["solution"] and c["solution"] == c["solution_plain"]
        layout = PastaLayout.parse(3, ids(b["solution"]), TAGS, TOKENIZER.decode)
        assert layout.malformed.total == 0 and text_schedule(b["solution"]) == layout.critical_path
        assert b["solution"].count("<sync/>") == (len(layout.forks) > 0)
    forks = [b["solution"].count("<promise") for b in mixed]
    chains = [b["prompt"].count("\n") - 1 for b in mixed]
    assert 0.35 < sum(forks) / sum(chains) < 0.65  # about half of the chains fork
    assert any(f == 0 for f in forks) and any(f == c for f, c in zip(forks, chains))
    with pytest.raises(ValueError, match=r"fork_prob must be in \[0, 1\], got 1.5"):
        PastaTask(fork_prob=1.5)


# catches: plain and annotated responses that differ in content (planted: chains in another order in
# the plain response -> fails), or an annotation left in the plain response.
def test_plain_response_is_the_annotated_one_without_annotations():
    strip = re.compile(r'<promise[^<>]*/>|<async>|</async>|<sync/>')
    for p in problems():
        assert strip.sub("", p["solution"]) == p["solution_plain"]
        assert not any(tag in p["solution_plain"] for tag in PASTA_TAGS)


# catches: a wrong answer (planted: the chains' start values summed) or chain value (planted: each step
# showing the value before it), a combination that does not add the finals (planted: the running sum adding
# each chain's start -> fails), a verifier that cannot read an annotated response.
def test_answers_follow_the_prompt_and_verify():
    verifier = ArithVerifier()
    for p in problems():
        *chains, question = p["prompt"].splitlines()
        finals = {}
        for line in chains:
            name, rest = line.split("=", 1)
            start, *ops = rest.split()
            finals[name] = int(start) + sum(int(op[1:]) for op in ops)
        assert question == "+".join(finals) + "=?"
        assert int(p["answer"]) == sum(finals.values())
        *body, combined, _, _ = p["solution_plain"].splitlines()[1:]  # chain lines, the sum, </think>, Answer
        lines = {line.split("=", 1)[0]: line for line in body}
        for name, line in zip(finals, chains):  # "A=47 a+5=52 b-3=49 A:49": each step redone from the prompt
            start, *steps, final = lines[name].split("=", 1)[1].split()
            value = int(start)
            for step, operand in zip(steps, line.split()[1:], strict=True):
                value += int(operand[1:])
                assert step == f"{operand}={value}"
            assert value == finals[name] and final == f"{name}:{value}"
        names, running = list(finals), finals[next(iter(finals))]  # "A:55+B:30=85+C:12=97"
        want = f"{names[0]}:{running}"
        for name in names[1:]:
            running += finals[name]
            want += f"+{name}:{finals[name]}={running}"
        assert combined == want
        for text in (p["solution"], p["solution_plain"]):
            assert verifier(text, p["answer"]).total == 1.0
        wrong = p["solution"].replace(f"{{{p['answer']}}}", f"{{{int(p['answer']) + 1}}}")
        assert verifier(wrong, p["answer"]).total == 0.0


# catches: a split whose first problems change with n, train and eval sharing prompts, settings ignored.
def test_splits_are_disjoint_stable_and_follow_the_settings():
    task = PastaTask(num_chains=(2, 2), num_steps=(9, 9), seed=3)
    train, more = task.problems(20), task.problems(40)
    assert more[:20] == train
    evals = task.problems(20, "eval")
    assert not {p["prompt"] for p in train} & {p["prompt"] for p in evals}
    for p in train:
        lines = p["prompt"].splitlines()
        assert len(lines) == 3 and all(len(line.split()) == 10 for line in lines[:2])
    assert PastaTask(seed=4).problems(5) != PastaTask(seed=3).problems(5)


@pytest.mark.parametrize("kwargs, message", [
    ({"num_chains": (1, 3)}, r"num_chains must be \(a, b\) with 2 <= a <= b <= 26, got \(1, 3\)"),
    ({"num_steps": (0, 4)}, r"num_steps must be \(a, b\) with 1 <= a <= b, got \(0, 4\)"),
    ({"max_operand": 0}, "max_operand must be >= 1, got 0"),
    ({"min_value": 10, "max_value": 12}, "max_value - min_value >= max_operand"),
    ({"num_chains": (2, 4)}, r"can need 32 step letters; at most 26"),  # 4 chains x 8 steps
])
def test_bad_settings_are_named(kwargs, message):
    # catches: settings that would loop forever or draw out-of-range values accepted silently
    with pytest.raises(ValueError, match=message):
        PastaTask(**kwargs)
    with pytest.raises(ValueError, match="unknown split 'dev'"):
        PastaTask().problems(1, "dev")
