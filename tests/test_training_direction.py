"""Bugs the suite once let through (issue 11): training toward the worse BoNBoN sample, the sampler's
logprobs of the wrong tokens in GRPO's ratio, and eval counting wrong answers as right.

Each test checks a direction or a value against something computed outside the code under test.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch

from sliderl.cluster.eval.evaluation import score
from sliderl.cluster.records import Problem
from sliderl.core.loader import load_model
from sliderl.core.trace import Trace
from sliderl.rewards.arith import ArithVerifier
from sliderl.trainer.algorithms import BoNBoNOptions, GRPOOptions
from sliderl.trainer.learner import Learner
from sliderl.trainer.learner_args import LearnerArgs
from sliderl.trainer.logprobs import trace_logprobs

SPEC = "full"


def trace(seed: int, n: int, **fields) -> Trace:
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, 256, (6,), generator=gen).tolist()
    completion = torch.randint(0, 256, (n,), generator=gen).tolist()
    return Trace(f"t{seed}", "g", "p", 0, 0, SPEC, prompt, completion, [-5.0] * n, "stop", temperature=1.0, **fields)


def sequence_logprob(path_or_model, t: Trace) -> float:
    model = load_model(path_or_model) if not isinstance(path_or_model, torch.nn.Module) else path_or_model
    with torch.no_grad():
        return float(trace_logprobs(model, t).sum())


def test_bonbon_step_moves_toward_the_best_sample(tiny_model_factory, tmp_path):
    # Catches: BoNBoN training toward the worse sample (chosen and rejected swapped in the pair, or the
    # score read the wrong way round). One step must raise log p(best) - log p(worst); planted by
    # swapping chosen/rejected in BoNBoN.select, the margin falls instead.
    path = tiny_model_factory(arch="qwen3")
    best = trace(1, 12, reward_components={"speedup": 2.0, "correctness": 1.0})
    worst = trace(2, 12, reward_components={"speedup": 1.0, "correctness": 0.0})
    middle = trace(3, 12, reward_components={"speedup": 1.5, "correctness": 0.0})
    learner = Learner(str(path), LearnerArgs(algo=BoNBoNOptions(alpha=0.5, beta=0.1), lr=5e-3, window_mode="full"))
    margin_before = sequence_logprob(learner.model, best) - sequence_logprob(learner.model, worst)
    metrics = learner.step([[worst, best, middle]])
    assert metrics.stepped
    margin_after = sequence_logprob(learner.model, best) - sequence_logprob(learner.model, worst)
    assert margin_after > margin_before + 0.1, (margin_before, margin_after)


def test_grpo_ratio_uses_the_sampler_logprob_of_each_token(tiny_model_factory):
    # Catches: the sampler's logprobs entering the loss misaligned with the tokens (flipped, shifted
    # by one). The loss is recomputed here by hand from the model's own logprobs and the per-token
    # sampler logprobs: token t's ratio is exp(lp_t - b_t), clipped to [1 - 0.2, 1 + 0.28], loss
    # -mean(min(r A, clip(r) A)). Planted by reversing the behaviour slice in TraceWindows.rows (trainer.trace_rows),
    # the loss differs.
    path = tiny_model_factory(arch="qwen3")
    model = load_model(path)
    a, b = trace(4, 10, reward=1.0), trace(5, 10, reward=0.0)
    shifts = torch.tensor([0.5, -0.5, 0.05, -0.3, 0.4, -0.05, 0.2, -0.6, 0.1, 0.0])
    rows = []
    for t in (a, b):
        with torch.no_grad():
            lp = trace_logprobs(model, t).double()
        t.logprobs = (lp + shifts.double()).tolist()  # the sampler saw each token at lp_t + shift_t
        rows.append(lp)
    learner = Learner(str(path), LearnerArgs(algo=GRPOOptions(), lr=0.0, window_mode="full"))
    metrics = learner.step([[a, b]])
    # group advantages: rewards (1, 0), mean 0.5, not scaled by std -> A = +0.5 and -0.5
    total, n = 0.0, 0
    for lp, t, adv in zip(rows, (a, b), (0.5, -0.5)):
        for lp_t, b_t in zip(lp.tolist(), t.logprobs):
            r = math.exp(lp_t - b_t)
            total += -min(r * adv, min(max(r, 0.8), 1.28) * adv)
            n += 1
    assert abs(metrics.loss - total / n) < 1e-5, (metrics.loss, total / n)


def test_eval_counts_only_right_answers(tmp_path):
    # Catches: eval counting wrong or unparseable answers as right (e.g. a score >= 0 threshold, or
    # the answer compared against itself). Hand-labelled completions: 2 of 5 are right.
    problems = [Problem(str(i), f"q{i}", ans) for i, ans in enumerate(["12", "7", "40", "3", "99"])]
    texts = ["</think> \\boxed{12}",  # right
             "</think> \\boxed{8}",  # wrong number
             "</think> the answer is 40",  # no box: wrong
             "</think> \\boxed{3}",  # right
             "<think> \\boxed{99} </think> so \\boxed{9}"]  # the boxed answer after </think> is 9: wrong
    outputs = [SimpleNamespace(text=t, token_ids=[0] * 4, kv=SimpleNamespace(mean_visible_tokens=4.0,
                                                                              peak_visible_tokens=4)) for t in texts]
    result = score(outputs, problems, ArithVerifier(), "full")
    assert result.accuracy == 2 / 5
