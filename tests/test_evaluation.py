"""TIP's evaluation: avg@k, pass@k and the cost numbers against hand-computed values; the comparison's
budget templates, its input errors, and one real `sliderl eval COMPARE.yaml` on a tiny model."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from sliderl.cluster.cli import main
from sliderl.cluster.config.compare import CompareConfig, fill_budget
from sliderl.cluster.eval.comparison import EntryResult, expand
from sliderl.cluster.eval.evaluation import SampledEval, pass_at_k, score_samples
from sliderl.cluster.eval.report import pareto_front
from sliderl.cluster.records import Problem
from sliderl.rewards.spec import CorrectnessTerm
from sliderl.rollout.sequence import KVUsage

ROOT = Path(__file__).resolve().parents[1]
VERIFIER = CorrectnessTerm().build("arith")  # 1 when the last \boxed{} holds the answer


class Completion:
    """The fields of a RequestOutput that scoring reads."""

    def __init__(self, text: str, tokens: int, mean_kv: float, peak_kv: int):
        self.text, self.token_ids = text, list(range(tokens))
        self.kv = KVUsage(peak_kv, mean_kv, 1, round(mean_kv * tokens))  # token steps: mean live KV x length


def test_pass_at_k_is_the_unbiased_estimate():
    # Catches: pass@k computed as avg (c/n: 1/4 = 0.25 in the first case, 2/5 in the second), n and c
    # swapped (pass_at_k(1, 4, 2) is refused: c > n), and the estimator's edges (none / all correct).
    # n=4, c=1, k=2: 1 - C(3,2)/C(4,2) = 1 - 3/6 = 0.5
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)
    # n=5, c=2, k=3: 1 - C(3,3)/C(5,3) = 1 - 1/10 = 0.9
    assert pass_at_k(5, 2, 3) == pytest.approx(0.9)
    # n=4, c=1, k=1: 1 - C(3,1)/C(4,1) = 1 - 3/4 = 0.25 (pass@1 is the fraction correct)
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    # k = n: 1 when any sample is correct, 0 when none: 1 - C(1,4)/C(4,4) = 1 - 0 = 1; 1 - C(4,4)/1 = 0
    assert pass_at_k(4, 3, 4) == 1.0 and pass_at_k(4, 0, 4) == 0.0
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k(4, 1, 5)


def test_score_samples_against_hand_computed_values():
    # Catches (each planted in score_samples / its helpers and seen failing here):
    # - pass@k computed as avg@k: 0.4167 instead of 0.6667;
    # - c and n swapped in the pass@k call: pass_at_k refuses c > n (ValueError);
    # - samples read sample-major (outputs[j * P + i]) instead of problem-major: each problem's "samples"
    #   then hold other problems' answers (correct counts 0, 1, 2: avg 0.25);
    # - mean live KV averaged over peaks (70), or peak taken as the largest mean (120);
    # - throughput from the mean tokens per completion instead of all tokens (10.5 / 2 = 5.25 tok/s);
    # - KV x steps taken as mean live KV x mean length (65 x 10.5 = 682.5) instead of each completion's own sum.
    problems = [Problem("p0", "q0", "11"), Problem("p1", "q1", "22"), Problem("p2", "q2", "33")]
    k = 4
    # problem 0: 0 of 4 correct, problem 1: 1 of 4, problem 2: 4 of 4
    texts = [["\\boxed{1}"] * 4, ["\\boxed{22}", "\\boxed{2}", "\\boxed{2}", "\\boxed{2}"], ["\\boxed{33}"] * 4]
    # mean KV 10, 20, ..., 120 (problem-major), peaks mean + 5, tokens 5, 6, ..., 16
    outputs = [Completion(t, 5 + n, 10.0 * (n + 1), 10 * (n + 1) + 5)
               for n, t in enumerate(t for row in texts for t in row)]
    result = score_samples(outputs, problems, k, VERIFIER, decode_seconds=2.0)
    # avg@4 = (0/4 + 1/4 + 4/4) / 3 = 1.25 / 3 = 0.41667
    assert result.avg_at_k == pytest.approx(1.25 / 3)
    # pass@4 = (0 + 1 + 1) / 3 (k = n: a problem passes when any sample is correct)
    assert result.pass_at_k == pytest.approx(2 / 3)
    # mean live KV = (10 + 20 + ... + 120) / 12 = 780 / 12 = 65; peak = 120 + 5 = 125
    assert result.mean_live_kv == pytest.approx(65.0) and result.peak_live_kv == 125
    # tokens = 5 + 6 + ... + 16 = 12 * (5 + 16) / 2 = 126; throughput = 126 / 2 s = 63 tok/s
    assert result.generated_tokens == 126 and result.tokens_per_second == pytest.approx(63.0)
    # KV x steps per completion: 10 (n + 1) (5 + n) for n = 0 .. 11, i.e. 10 * sum(n^2 + 6n + 5)
    # = 10 * (506 + 396 + 60) = 9620 over 12 completions = 801.67 (not 65 x 10.5 = 682.5)
    assert result.kv_token_steps == pytest.approx(9620 / 12)
    assert result.decode_seconds == 2.0 and result.num_problems == 3 and result.k == 4
    with pytest.raises(ValueError, match="3 problems x k=4"):
        score_samples(outputs[:-1], problems, k, VERIFIER, 2.0)


def _run(avg: float, kv: float) -> SampledEval:
    return SampledEval(4, 2, avg, avg, kv, int(kv) + 1, 100, 2.0, 50.0)


def test_seeds_report_mean_and_sample_std():
    # Catches: the population std (0.1 here) where the report promises the sample std over seeds.
    # avg 0.5 and 0.7: mean 0.6; sample std = sqrt(((-0.1)^2 + 0.1^2) / (2 - 1)) = sqrt(0.02) = 0.14142
    result = EntryResult("Dense", "ckpt", "full", (_run(0.5, 40.0), _run(0.7, 50.0)), (0, 1))
    assert result.mean("avg_at_k") == pytest.approx(0.6)
    assert result.std("avg_at_k") == pytest.approx(math.sqrt(0.02))
    assert EntryResult("Dense", "ckpt", "full", (_run(0.5, 40.0),), (0,)).std("avg_at_k") == 0.0


def test_budgets_are_fractions_of_the_reference_mean_live_kv():
    # Catches: a budget from the reference's peak (61) instead of its mean over seeds (50), Python's
    # half-to-even round (0.25 x 50 = 12.5 -> 12, not 13), and {budget-N} ignoring N (window = budget).
    reference = EntryResult("Dense", "ckpt", "full", (_run(0.5, 40.0), _run(0.7, 60.0)), (0, 1))  # mean KV 50
    entry = CompareConfig(entries=[{"label": "Dense"}, {"label": "S", "kv": "streaming:4:{budget-4}",
                                                        "budget_of": "Dense", "budgets": [0.25, 1.0]}]).entries[1]
    low, full = expand(entry, "ckpt", reference)
    # 0.25 x 50 = 12.5 -> 13 (half up); window 13 - 4 = 9. 1.0 x 50 = 50; window 46
    assert (low.label, low.budget, low.kv, low.budget_of) == ("S@25%", 13, "streaming:4:9", "Dense")
    assert (full.label, full.budget, full.kv) == ("S@100%", 50, "streaming:4:46")
    assert fill_budget("h2o:{budget}", 12) == "h2o:12"
    tiny = CompareConfig(entries=[{"label": "Dense"}, {"label": "S", "kv": "streaming:4:{budget-4}",
                                                       "budget_of": "Dense", "budgets": [0.05]}]).entries[1]
    with pytest.raises(ValueError, match="budget 3, giving 'streaming:4:-1'.*raise the fraction"):
        expand(tiny, "ckpt", reference)  # 0.05 x 50 = 2.5 -> 3, window 3 - 4 < 1


def test_budgets_of_the_reference_peak_when_asked():
    # Catches: budget_metric ignored (the mean, 50, used: 25 and 50), and peak-budgeted entries labelled like
    # mean-budgeted ones (two "S@100%" rows in one table). Issue 41 asks for H2O and sliding windows at Dense's
    # peak live KV as well as its mean.
    reference = EntryResult("Dense", "ckpt", "full", (_run(0.5, 40.0), _run(0.7, 60.0)), (0, 1))  # peaks 41, 61
    entry = CompareConfig(entries=[{"label": "Dense"}, {"label": "S", "kv": "h2o:{budget}", "budget_of": "Dense",
                                                        "budgets": [0.5, 1.0], "budget_metric": "peak_live_kv"}]
                          ).entries[1]
    half, full = expand(entry, "ckpt", reference)
    # mean peak over seeds (41 + 61) / 2 = 51; 0.5 x 51 = 25.5 -> 26 (half up)
    assert (half.label, half.budget, half.kv) == ("S@50% of peak", 26, "h2o:26")
    assert (full.label, full.budget, full.kv) == ("S@100% of peak", 51, "h2o:51")
    assert entry.expanded_labels() == ["S@50% of peak", "S@100% of peak"]
    # Catches an h2o budget below the engine's two pages (2 x 16 = 32 tokens) reaching the engine mid-comparison,
    # which then exits with the engine's message after the earlier entries ran (seen with a short-trace Dense:
    # h2o:18); the template's own message asks for a larger fraction instead.
    assert [p.kv for p in expand(entry, "ckpt", reference, block_size=8)] == ["h2o:26", "h2o:51"]  # 26 >= 16
    with pytest.raises(ValueError, match=r"budget 26, giving 'h2o:26'.*at least 2 pages.*raise the fraction"):
        expand(entry, "ckpt", reference, block_size=16)


def test_a_template_cannot_be_a_reference():
    # Catches: chained templates (a budget of a budget), which would run before their reference exists.
    with pytest.raises(ValueError, match="budget_of 'S' is itself a budget template; plain entries: Dense"):
        CompareConfig(entries=[{"label": "Dense"},
                               {"label": "S", "kv": "sliding_window:{budget}", "budget_of": "Dense", "budgets": [0.5]},
                               {"label": "T", "kv": "sliding_window:{budget}", "budget_of": "S", "budgets": [0.5]}])


def test_pareto_front_by_direction():
    # Catches: a frontier that ignores which way the cost axis is better (the throughput front would
    # keep A and drop C), or that keeps dominated points.
    # A(10, .5) B(20, .6) C(30, .55) D(15, .4): lower x better -> A, B (C loses to B, D to A);
    # higher x better -> B, C (A and D lose to B)
    points = [(10, 0.5), (20, 0.6), (30, 0.55), (15, 0.4)]
    assert pareto_front(points, lower_x_is_better=True) == [0, 1]
    assert pareto_front(points, lower_x_is_better=False) == [1, 2]


# ---------------------------------------------------------------------------------- through the CLI

RECIPE = str(ROOT / "configs" / "compare-tiny.yaml")
SMALL = ["eval.num_problems=4", "eval.compare.k=2", "sampling.max_tokens=16", "engine.num_blocks=256"]


def _entries(*entries: str) -> str:
    return "eval.compare.entries=[" + ", ".join(entries) + "]"


def test_compare_mode_input_errors_exit_2_before_any_engine(tiny_model_factory, tmp_path, capsys, monkeypatch):
    # Catches: a mistake in the entries found only after engines ran (the LLM below refuses to be
    # built), a traceback instead of one line, or another exit code. Planted: dropping the budget_of
    # check makes the unknown-label case fail with a KeyError after Dense ran.
    from sliderl import rollout
    monkeypatch.setattr(rollout, "LLM", lambda *a, **k: pytest.fail("an engine was built"))
    model = tiny_model_factory("qwen3")
    capsys.readouterr()  # building the model may print progress
    dense = f"{{label: Dense, checkpoint: {model}, kv: full}}"
    cases = [
        (_entries(dense, f"{{label: S, checkpoint: {model}, kv: 'streaming:4:{{budget-4}}', budget_of: Dns, "
                         "budgets: [0.5]}"), "budget_of 'Dns' names no entry without a budget; plain entries: Dense"),
        (_entries(f"{{label: Dense, checkpoint: {tmp_path / 'nowhere'}, kv: full}}"),
         "entry 'Dense': checkpoint"),
        (_entries(f"{{label: Dense, checkpoint: {model}, kv: 'streaming:4'}}"), "takes 2 integer argument(s)"),
        (_entries(dense, f"{{label: S, checkpoint: {model}, kv: 'streaming:4:{{budget-4}}', budget_of: Dense, "
                         "budgets: [0.5, 0]}"), "greater than 0"),
        (_entries(dense, f"{{label: S, checkpoint: {model}, kv: 'streaming:4:32', budget_of: Dense, "
                         "budgets: [0.5]}"), "needs a {budget} or {budget-N} placeholder"),
        (_entries(dense, dense), "repeated: Dense"),
    ]
    for entries, fragment in cases:
        code = main(["eval", RECIPE, *SMALL, entries, f"eval.compare.output_dir={tmp_path / 'out'}"])
        err = capsys.readouterr().err
        assert code == 2, err
        assert err.count("\n") == 1 and err.startswith("sliderl eval: error: ") and fragment in err, err
    assert not (tmp_path / "out").exists()


def test_compare_runs_through_the_cli(tiny_model_factory, tmp_path, capsys):
    # Catches: budgets taken from anything but the reference's measured mean live KV, a table without
    # one row per expanded entry, missing outputs, and a budgeted policy that does not bound live KV
    # (the streaming entry at 25% must hold less than full).
    model = tiny_model_factory("qwen3")
    out = tmp_path / "out"
    code = main(["eval", RECIPE, *SMALL, "eval.compare.seeds=[0, 1]", f"eval.compare.output_dir={out}", _entries(
        f"{{label: Dense, checkpoint: {model}, kv: full}}",
        f"{{label: Streaming, checkpoint: {model}, kv: 'streaming:4:{{budget-4}}', budget_of: Dense, "
        "budgets: [0.25, 1.0]}")])
    stdout = capsys.readouterr().out
    assert code == 0
    for name in ("config.yaml", "results.md", "results.jsonl", "pareto_live_kv.png", "pareto_throughput.png",
                 "pareto_decode_time.png"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [r["label"] for r in rows] == ["Dense", "Streaming@25%", "Streaming@100%"]
    table = [line for line in (out / "results.md").read_text().splitlines() if line.startswith("| ")]
    assert len(table) == 1 + 3 and all(label in stdout for label in ("Streaming@25%", "Streaming@100%"))
    dense, quarter, whole = rows
    # the reference's mean live KV, averaged over its two seeds' runs, is what the budgets scale
    measured = sum(run["mean_live_kv"] for run in dense["runs"]) / 2
    for row, fraction in ((quarter, 0.25), (whole, 1.0)):
        budget = math.floor(fraction * measured + 0.5)
        assert row["budget"] == budget and row["kv"] == f"streaming:4:{budget - 4}" and row["budget_of"] == "Dense"
        assert row["peak_live_kv"] <= budget
    assert quarter["mean_live_kv"] < dense["mean_live_kv"]
    assert len(dense["runs"]) == 2 and dense["seeds"] == [0, 1] and "±" in (out / "results.md").read_text()
    for row in rows:
        assert 0.0 <= row["avg_at_k"] <= row["pass_at_k"] <= 1.0 and row["num_problems"] == 4 and row["k"] == 2
        assert row["tokens_per_second"] > 0 and row["decode_seconds"] > 0


def test_a_comparison_cut_short_keeps_the_entries_it_finished(tiny_model_factory, tmp_path, monkeypatch, capsys):
    # Catches: results.jsonl/results.md written only at the end, so a comparison stopped in its third entry (a
    # Ctrl-C here; a time box or a lost machine alike: tip_seeds' GPU call lost every seed's 7 finished rows
    # this way) leaves nothing. The first two entries really run; the third is interrupted. Planted by dropping
    # the per-entry write in the CLI, results.jsonl does not exist and this fails.
    import sliderl.cluster.eval.comparison as comparison
    real, calls = comparison.run_entry, []

    def cut_at_the_third(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(comparison, "run_entry", cut_at_the_third)
    model = tiny_model_factory("qwen3")
    out = tmp_path / "out"
    code = main(["eval", RECIPE, *SMALL, f"eval.compare.output_dir={out}", _entries(
        f"{{label: Dense, checkpoint: {model}, kv: full}}",
        f"{{label: Streaming, checkpoint: {model}, kv: 'streaming:4:{{budget-4}}', budget_of: Dense, "
        "budgets: [0.25, 1.0]}")])
    assert code == 130, capsys.readouterr().err
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [r["label"] for r in rows] == ["Dense", "Streaming@25%"]
    assert rows[0]["num_problems"] == 4 and len(rows[0]["runs"]) == 1
    table = (out / "results.md").read_text()
    assert "Streaming@25%" in table and "Streaming@100%" not in table
    assert not list(out.glob(".*.tmp"))
