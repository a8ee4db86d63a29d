"""Pasta's stage 2 (configs/pasta-bonbon.yaml): the theoretical speedup against Baseline-SFT's length, BoNBoN's
pairs and β, Baseline-SFT's lengths kept in the run directory, the evaluation's speedup column, bad settings.

References: hand-counted token steps (the tiny byte tokenizer: one token per byte, one per Pasta-Lang tag),
IPO's closed form at the first step (policy = reference), and the harmonic numbers written out.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from sliderl.cluster.actors.baseline import FILE, BaselineLengths, read_lengths, settle_lengths
from sliderl.cluster.eval.evaluation import SampledEval
from sliderl.cluster.records import Problem
from sliderl.cluster.storage.root import Storage
from sliderl.core.pasta import PASTA_TOKENS, PastaTokenIds
from sliderl.core.tiny import build_tokenizer
from sliderl.core.trace import Trace
from sliderl.rewards import CorrectnessTerm, RewardInput, RewardSpec, SpeedupTerm
from sliderl.trainer.algorithms import BoNBoN, BoNBoNOptions

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = build_tokenizer(extra_special_tokens=PASTA_TOKENS)
TAGS = PastaTokenIds.from_tokenizer(TOKENIZER)
EOS = TOKENIZER.eos_token_id


def ids(text: str) -> list[int]:
    return TOKENIZER(text).input_ids


# A response the runtime could have decoded: "ab", a promise (tokens="1") whose fork is "<async>xyz</async>"
# (the runtime's <async> forced), then "c", "<sync/>", "d". Steps on the critical path, one per token:
#   main: a 1, b 2, <promise 3, ' tokens="1"' (11 bytes) 4..14, /> 15 -> the fork starts
#   fork: <async> 16, x 17, y 18, z 19, </async> 20
#   main: c 16, <sync/> 17 -> waits for the fork (20), d 21
# critical path 21 of 23 tokens (2 + 13 + 5 + 3).
FORKED = ids('ab<promise tokens="1"/>') + [TAGS.async_open] + ids("xyz") + [TAGS.async_close] + ids("c<sync/>d")
FORCED = [t == TAGS.async_open for t in FORKED]


def speedup_record(completion: list[int], baseline: int, forced: list[bool] | None = FORCED, answer: str = "7"):
    spec = RewardSpec(correctness=CorrectnessTerm(), speedup=SpeedupTerm(baseline_model="unused"))
    text = TOKENIZER.decode(completion)
    return spec.build("pasta", TOKENIZER).score(RewardInput(text, answer, prompt_token_ids=[1, 2, 3],
                                                            completion_token_ids=completion, forced=forced,
                                                            baseline_tokens=baseline))


# catches: the speedup of the response's own length (tags included) over its critical path (planted: 23 / 21,
# the departure the thesis does not make) and a critical path that is not the runtime's (a fork not running
# beside the main thread, or a sync not waiting for it).
def test_speedup_is_the_baselines_length_over_the_critical_path():
    assert len(FORKED) == 23
    record = speedup_record(FORKED, baseline=42)
    assert record.components["speedup"] == pytest.approx(42 / 21)
    assert record.info["speedup/critical_path"] == 21.0 and record.info["speedup/num_tokens"] == 23.0
    assert record.info["speedup/num_forks"] == 1.0 and record.info["speedup/baseline_tokens"] == 42.0
    assert record.components["correctness"] == 0.0 and record.total == pytest.approx(42 / 21)
    plain = ids("abcdefgh")  # nothing forks: the critical path is the length
    assert speedup_record(plain, baseline=4, forced=[False] * 8).components["speedup"] == pytest.approx(0.5)


# catches: the disagreement between the parser and the runtime on an <async> that follows a "/>" that did not
# fork (past pasta_max_forks): the runtime reads the main thread's sampled <async> as plain text, so the
# speedup's parser must too when given the forced flags (planted: forced flags ignored -> a fork, path 21).
def test_a_sampled_async_after_an_unforked_promise_is_plain_text():
    sampled = [False] * len(FORKED)  # the main thread sampled this <async>: the promise forked nothing
    record = speedup_record(FORKED, baseline=46, forced=sampled)
    assert record.info["speedup/num_forks"] == 0.0 and record.info["speedup/critical_path"] == 23.0
    assert record.components["speedup"] == pytest.approx(2.0)
    with pytest.raises(ValueError, match="needs the response's token ids and Baseline-SFT's length"):
        RewardSpec(speedup=SpeedupTerm(baseline_model="m")).build("pasta", TOKENIZER).score(RewardInput("x", "1"))


def trace(index: int, speedup: float, correct: float, n: int = 6) -> Trace:
    return Trace(f"t{index}", "g", "p", 0, 0, "full", [1, 2], list(range(3, 3 + n)), [-1.0] * n, "stop",
                 temperature=1.0, reward=speedup + correct, reward_components={"speedup": speedup,
                                                                                "correctness": correct})


# catches: pairs picked by another score than speedup + λ·quality (planted: chosen and rejected swapped, or
# λ ignored): with λ = 1 the fastest right answer is the best and a wrong one the worst, however fast.
def test_bonbon_pairs_the_best_and_worst_by_the_latency_aware_score():
    # scores speedup + 1·correct: [1.10 + 1, 1.35 + 1, 1.60 + 0, 0.95 + 1] = [2.10, 2.35, 1.60, 1.95]
    group = [trace(0, 1.10, 1.0), trace(1, 1.35, 1.0), trace(2, 1.60, 0.0), trace(3, 0.95, 1.0)]
    selection = BoNBoN(BoNBoNOptions(quality_weight=1.0)).select([group])
    assert [t.trace_id for t in selection.traces] == ["t1", "t2"] and selection.roles == ["chosen", "rejected"]
    # λ = 0.2: [1.30, 1.55, 1.60, 1.15] -> the fast wrong answer wins, the slowest right one loses
    selection = BoNBoN(BoNBoNOptions(quality_weight=0.2)).select([group])
    assert [t.trace_id for t in selection.traces] == ["t2", "t3"]
    assert selection.group_sizes == [4, 4]


# catches: IPO's β fixed at n = 10 while groups hold another number of samples (planted: bonbon_beta(10) ->
# target 9·H_9 = 25.46, loss 648 per pair), and a β shared by pairs from groups of different sizes.
def test_bonbon_beta_follows_the_number_of_samples(tiny_model_factory):
    from sliderl.trainer.learner import Learner

    # BoNBoN's β = 1 / (2 (n-1) H_{n-1}), IPO's target margin 1/(2β) = (n-1) H_{n-1}:
    #   n = 4: 3 · (1 + 1/2 + 1/3) = 5.5;  n = 3: 2 · (1 + 1/2) = 3.0
    # At the first step the policy is the reference, so the margin h = 0 and IPO = target² per pair:
    #   mean(5.5², 3.0²) = (30.25 + 9) / 2 = 19.625
    learner = Learner(str(tiny_model_factory(arch="qwen3")), algo=BoNBoNOptions(alpha=0.0), lr=1e-3,
                      window_mode="full")
    four = [trace(i, 1.0 + 0.1 * i, 1.0) for i in range(4)]
    three = [trace(10 + i, 1.0 + 0.1 * i, 1.0) for i in range(3)]
    metrics = learner.step([four, three])
    assert metrics.algorithm["ipo/margin_mean"] == 0.0
    assert metrics.algorithm["ipo/loss"] == pytest.approx(19.625, rel=1e-5)
    fixed = Learner(str(tiny_model_factory(arch="qwen3")), algo=BoNBoNOptions(alpha=0.0, beta=0.1), lr=1e-3,
                    window_mode="full")
    assert fixed.step([four, three]).algorithm["ipo/loss"] == pytest.approx(25.0, rel=1e-5)  # (1 / 0.2)²


# catches: Baseline-SFT's lengths generated again on every start (planted: the file never read -> the second
# settle calls the generator), a file reused after the baseline model changed, and problems not given them.
def test_baseline_lengths_are_written_once_and_reused(tmp_path):
    storage = Storage(tmp_path / "run")
    storage.make_dir(storage.root)
    problems = [Problem(f"p{i}", f"prompt {i}", "0", (1, 2, i)) for i in range(3)]
    calls = []

    def generate(prompts):
        calls.append(prompts)
        return [10 + len(calls) * 100 + p[-1] for p in prompts]

    first, made = settle_lengths(storage, "/models/base", 64, problems, generate)
    assert made and calls == [[[1, 2, 0], [1, 2, 1], [1, 2, 2]]]
    assert [p.baseline_tokens for p in first] == [110, 111, 112]
    on_disk = json.loads((tmp_path / "run" / FILE).read_text())
    assert on_disk == {"model": "/models/base", "max_tokens": 64, "lengths": {"p0": 110, "p1": 111, "p2": 112}}
    again, made = settle_lengths(storage, "/models/base", 64, problems, generate)  # a resume: read, not generated
    assert not made and len(calls) == 1 and again == first
    other, made = settle_lengths(storage, "/models/other", 64, problems, generate)  # another baseline: generated
    assert made and len(calls) == 2 and [p.baseline_tokens for p in other] == [210, 211, 212]
    assert read_lengths(storage) == BaselineLengths("/models/other", 64, {"p0": 210, "p1": 211, "p2": 212})


# catches: a speedup averaged arithmetically (planted: fmean of the ratios -> 1.375), or per sample against
# the baseline's own sample rather than its mean on the problem.
def test_evaluation_speedup_is_the_geometric_mean_over_samples():
    def run(lengths, paths, k=2):
        return SampledEval(2, k, 0.5, 0.5, 0.0, 0, sum(lengths), 1.0, 1.0, tuple(lengths), tuple(paths))

    baseline = run([30, 50, 20, 20], [30, 50, 20, 20])  # mean lengths per problem: 40, 20
    pasta = run([99, 99, 99, 99], [20, 40, 40, 10])  # ratios 40/20 = 2, 40/40 = 1, 20/40 = 0.5, 20/10 = 2
    assert pasta.with_speedup(baseline).speedup == pytest.approx(math.exp((2 * math.log(2) + math.log(0.5)) / 4))
    assert pasta.with_speedup(baseline).speedup == pytest.approx(2 ** 0.25)


# catches: a report that leaves out the speedup column or the quality-vs-speedup plot when the comparison
# has a speedup baseline (and one that shows an empty column without it).
def test_report_has_the_speedup_column_and_plot(tmp_path):
    from sliderl.cluster.eval.comparison import EntryResult
    from sliderl.cluster.eval.report import markdown_table, write_report

    def result(label, accuracy, speedup):
        run = SampledEval(4, 1, accuracy, accuracy, 0.0, 0, 40, 1.0, 40.0, (10,) * 4, (10,) * 4, speedup)
        return EntryResult(label, "ckpt", "pasta", (run,), (0,))

    results = [result("Baseline-SFT", 0.5, 1.0), result("Pasta-SFT", 0.5, 1.1), result("Pasta-BoNBoN", 0.45, 1.3)]
    written = write_report(results, tmp_path)
    assert tmp_path / "pareto_speedup.png" in written and (tmp_path / "pareto_speedup.png").stat().st_size > 0
    assert "| speedup |" in markdown_table(results) and "| 1.300 |" in markdown_table(results)
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [r["speedup"] for r in rows] == [1.0, 1.1, 1.3] and "lengths" not in rows[0]["runs"][0]
    plain = [result("Dense", 0.5, None)]
    assert "speedup" not in markdown_table(plain) and "pareto_speedup.png" not in {p.name for p in
                                                                                   write_report(plain, tmp_path / "x")}


# ---- bad settings: exit 2 before Ray, nothing written ------------------------------------------------
BAD = [
    (["reward.speedup.baseline_model=null"], "speedup needs baseline_model: the Baseline-SFT checkpoint"),
    (["reward.speedup.baseline_model=/nonexistent/base"], "reward.speedup.baseline_model '/nonexistent/base' is not"),
    (["learner.algo.quality_weight=-1"], "quality_weight must be >= 0, got -1.0"),
    (["learner.algo.beta=0"], "beta must be > 0 or None, got 0"),
    (["engine.kv=full"], "reward.speedup is the critical path of a Pasta-Lang response"),
]


# catches: a missing or absent Baseline-SFT checkpoint found only once Ray runs (planted: the check dropped
# from run_plan.prepare -> Ray starts, the run directory is written, the baseline's task fails: exit 1), a
# negative λ accepted, the speedup scored under a KV policy that decodes no forks.
@pytest.mark.parametrize("overrides, fragment", BAD, ids=[o[0] for o, _ in BAD])
def test_bad_pasta_bonbon_settings_exit_2_before_ray(overrides, fragment, tmp_path, capsys):
    import ray

    from sliderl.cluster.cli import main

    was_running = ray.is_initialized()
    run_dir, cache = tmp_path / "run", tmp_path / "cache"
    code = main(["train", str(ROOT / "configs/pasta-bonbon.yaml"), *overrides, f"run_dir={run_dir}",
                 f"warmstart.cache_dir={cache}", "warmstart.enabled=false", "ray.num_cpus=1"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and fragment in err, err
    assert ray.is_initialized() == was_running and not run_dir.exists() and not cache.exists()


# ---- the stage as a job, on Ray ----------------------------------------------------------------------
# catches: Baseline-SFT's lengths not reaching the reward (planted: problems without baseline_tokens -> every
# reward fails, no group trains), lengths of another prompt or model than the baseline's greedy responses
# (checked against Hugging Face's own greedy generate), the file generated again on resume (planted:
# settle_lengths never reading it -> the resumed run rewrites it), a speedup missing from the step metrics.
@pytest.mark.slow
def test_the_stage_runs_on_ray_and_reuses_the_baseline_lengths_on_resume(tiny_model_factory, tmp_path, capfd):
    import ray
    import torch
    from transformers import AutoModelForCausalLM

    from sliderl.cluster.actors.placement import start_local_ray
    from sliderl.cluster.config.base import load_config
    from sliderl.cluster.config.train import TrainConfig
    from sliderl.cluster.run.driver import train
    from sliderl.cluster.storage.trace_log import TraceLog
    from sliderl.core.pasta import PastaLayout

    pasta, base = tiny_model_factory("qwen3", extra_special_tokens=PASTA_TOKENS), tiny_model_factory("qwen3")
    run_dir = tmp_path / "run"
    overrides = ["model.type=hf", f"model.path={pasta}", "warmstart.enabled=false", f"reward.speedup.baseline_model={base}",
                 f"run_dir={run_dir}", "task.train_size=3", "task.eval_size=2", "eval.num_problems=2", "eval.before=false",
                 "eval.after=false", "sampling.max_tokens=12", "train.steps=2", "train.groups_per_step=1",
                 "rollout.group_size=3", "rollout.num_cpus=0.5", "engine.num_blocks=512", "monitor.wandb.mode=disabled",
                 "monitor.include_dashboard=false", "monitor.plots=false", "ray.num_cpus=2"]
    owns = not ray.is_initialized()
    if owns:
        start_local_ray(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        first = train(load_config(TrainConfig, str(ROOT / "configs/pasta-bonbon.yaml"), overrides))
        written = (run_dir / FILE).stat().st_mtime_ns
        resumed = train(load_config(TrainConfig, str(ROOT / "configs/pasta-bonbon.yaml"),
                                    overrides + ["resume=true", "train.steps=3"]))
    finally:
        if owns:
            ray.shutdown()
    assert first.state.step == 2 and resumed.state.step == 3
    assert (run_dir / FILE).stat().st_mtime_ns == written and "Baseline-SFT lengths read from" in capfd.readouterr().out
    lengths = read_lengths(Storage(run_dir)).lengths
    traces = TraceLog(run_dir).read().to_pylist()
    assert len(lengths) == 3 and {t["prompt_id"] for t in traces} <= set(lengths)
    hf = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    for trace in traces:
        prompt = torch.tensor([trace["prompt_token_ids"]])
        with torch.no_grad():
            greedy = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12, do_sample=False,
                                 eos_token_id=EOS, pad_token_id=EOS)[0, prompt.shape[1]:].tolist()
        assert lengths[trace["prompt_id"]] == (greedy.index(EOS) + 1 if EOS in greedy else len(greedy))
        layout = PastaLayout.parse(len(trace["prompt_token_ids"]), trace["completion_token_ids"], TAGS,
                                   TOKENIZER.decode, trace["forced"])
        speedup = dict(trace["reward_components"])["speedup"]
        assert speedup == pytest.approx(lengths[trace["prompt_id"]] / layout.critical_path)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(r["speedup"] > 0 for r in rows) and len(rows) == 3
