"""Bad input a user's dataset or filesystem can give `sliderl train` (issue 11, bugs 3 and 7): stopped
before Ray with the row or path named, or — when asked — left out and counted. Never trained on."""

from __future__ import annotations

import json
import math

import pytest

from sliderl.cluster.cli import main
from sliderl.cluster.config.base import load_config
from sliderl.cluster.config.train import TrainConfig
from sliderl.cluster.errors import ConfigError
from sliderl.cluster.run.plan import prepare
from sliderl.cluster.storage.data import load_problems


def write_rows(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


ROWS = [{"prompt": "1 + 1 =", "answer": "2"}, {"prompt": "2 + 2 =", "answer": None},
        {"prompt": None, "answer": "6"}, {"prompt": "4 + 4 =", "answer": "8"}, {"prompt": "  ", "answer": "1"}]


def test_a_row_without_an_answer_stops_with_its_index(tmp_path):
    # Catches: a null answer turned into the text "None" (str(None)) and rolled out and rewarded
    # against it. Planted by dropping the blank check, no error is raised.
    source = write_rows(tmp_path / "d.jsonl", ROWS)
    with pytest.raises(ConfigError, match=r"row 1 has no 'answer' \(got None\).*data.skip_invalid=true"):
        load_problems(source, "train", "prompt", "answer")


def test_skip_invalid_leaves_bad_rows_out_and_counts_them(tmp_path, capsys):
    # Catches: skipped rows still reaching the prompt stream, or skipped silently.
    source = write_rows(tmp_path / "d.jsonl", ROWS)
    problems = load_problems(source, "train", "prompt", "answer", skip_invalid=True)
    assert [(p.prompt, p.answer) for p in problems] == [("1 + 1 =", "2"), ("4 + 4 =", "8")]
    assert "left out 3 rows" in capsys.readouterr().out


def test_bad_rows_end_sliderl_train_before_ray(tmp_path, capsys):
    # Catches: the bad row found only inside a rollout worker. Exit 2, one line, Ray never started.
    import ray

    was_running = ray.is_initialized()
    source = write_rows(tmp_path / "d.jsonl", ROWS)
    code = main(["train", "task.type=math", f"data.source={source}", "warmstart.enabled=false",
                 f"run_dir={tmp_path / 'run'}", "eval.before=false", "eval.after=false"])
    err = capsys.readouterr().err
    assert code == 2 and "row 1 has no 'answer'" in err and err.count("\n") == 1, err
    assert ray.is_initialized() == was_running


def test_prompts_longer_than_the_engine_allows_are_left_out_before_the_run(tmp_path, tiny_model_factory, capsys):
    # Catches: a prompt that does not fit max_model_len reaching a worker and killing the run mid-way
    # ("prompt of N tokens does not fit"). Byte-level tokenizer: a prompt of n ASCII chars is n tokens
    # raw (data.chat_template=false; the templated length: tests/test_prompts.py).
    model = tiny_model_factory(arch="qwen3")
    rows = [{"prompt": "x" * n, "answer": "1"} for n in (10, 40, 12, 100)]
    source = write_rows(tmp_path / "d.jsonl", rows)
    base = ["task.type=math", f"data.source={source}", "warmstart.enabled=false", "model.type=hf",
            f"model.path={model}", "eval.before=false", "eval.after=false", "data.chat_template=false"]
    plan = prepare(load_config(TrainConfig, None, [*base, "engine.max_model_len=32", f"run_dir={tmp_path / 'a'}"]))
    assert [len(p.prompt) for p in plan.train_problems] == [10, 12]
    assert "left out 2 of 4 train problems" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="no train prompt fits max_model_len=8"):
        prepare(load_config(TrainConfig, None, [*base, "engine.max_model_len=8", f"run_dir={tmp_path / 'b'}"]))


def test_an_unwritable_run_dir_is_one_line_before_ray(tmp_path, capsys):
    # Catches: NotADirectoryError / PermissionError tracebacks from deep in the run. A run_dir under a
    # file can never be created, for root too.
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    code = main(["train", f"run_dir={blocker / 'run'}", "warmstart.enabled=false"])
    err = capsys.readouterr().err
    assert code == 2 and "cannot be written" in err and str(blocker / "run") in err and err.count("\n") == 1, err


def test_a_run_that_trains_nothing_exits_1_and_says_why(tmp_path, tiny_model_factory, capsys):
    # Catches: a run whose every group was skipped (here: a random model never answers right, so
    # every group has zero reward variance) reporting success with exit 0. Planted by returning 0
    # regardless in cli.run_train, this fails.
    from cluster_jobs import tiny_overrides

    model = tiny_model_factory("qwen3")
    code = main(["train", *tiny_overrides(model, tmp_path / "run"), "reward={correctness: 1.0}", "train.steps=2",
                 "ray.num_cpus=2", "monitor.include_dashboard=false", "eval.after=true"])
    out, err = capsys.readouterr()
    assert code == 1, err
    assert "no optimizer step was taken in 2 steps: every group was skipped (zero_variance_groups=4)" in err, err
    # also catches the summary printing the evaluation twice (the run's summary has the line, and the CLI added
    # its own): exactly one "eval after" line
    assert out.count("\n  eval after") == 1, out[-2000:]


def test_a_reward_that_raises_skips_its_group_and_the_worker_goes_on(tiny_model_factory, capsys):
    # Catches (issue 11, bug 4): a reward term that raises killed the worker's scorer thread and with it
    # the run. Here the arith verifier really raises (a problem without a reference answer): the
    # group comes out with NaN rewards and reward_error, the message names the trace, the worker keeps
    # serving, and GRPO skips the group and counts it. Planted by calling the reward without the
    # try/except, the group never arrives and the worker reports the error.
    import queue as std_queue

    from sliderl.cluster.actors.rollout_worker import RolloutWorker
    from sliderl.cluster.records import Problem, PromptGroup
    from sliderl.rewards import RewardSpec
    from sliderl.rollout import EngineArgs, SamplingParams
    from sliderl.trainer.algorithms import GRPO, GRPOOptions

    out: std_queue.Queue = std_queue.Queue()
    worker = RolloutWorker(0, str(tiny_model_factory("qwen3")), 0, EngineArgs(num_blocks=64),
                           SamplingParams(max_tokens=4), RewardSpec(), "arith", out)
    try:
        worker.submit([PromptGroup("g00000000", Problem("p0", "1 + 1 =", None), 2, 7),
                       PromptGroup("g00000001", Problem("p1", "2 + 2 =", "4"), 2, 9)])
        groups = {g.group_id: g for g in (out.get(timeout=120), out.get(timeout=120))}
        assert worker.status().error is None
    finally:
        worker.stop()
    bad, good = groups["g00000000"], groups["g00000001"]
    assert all(math.isnan(t.reward) and t.reward_components == {"reward_error": 1.0} for t in bad.traces)
    assert all(t.reward == 0.0 for t in good.traces)  # a random model's 4 tokens hold no boxed 4
    assert "the reward failed on trace g00000000-0-w0" in capsys.readouterr().err
    selection = GRPO(GRPOOptions()).select([bad.traces, good.traces])
    assert selection.metrics["skipped_groups_nonfinite_reward"] == 1.0


def test_no_fitting_prompt_is_an_error_before_the_warm_start(tmp_path, tiny_model_factory):
    # Catches: the prompt-length check running after the warm start, so a user waits for SFT before
    # learning that no prompt fits. With the warm start enabled, its cache must stay empty.
    model = tiny_model_factory(arch="qwen3")
    source = write_rows(tmp_path / "d.jsonl", [{"prompt": "x" * 40, "answer": "1"}])
    pairs = write_rows(tmp_path / "p.jsonl", [{"prompt": "a", "completion": "b"}] * 80)
    cfg = load_config(TrainConfig, None, [
        "task.type=math", f"data.source={source}", "model.type=hf", f"model.path={model}",
        "engine.max_model_len=8", f"run_dir={tmp_path / 'run'}", f"warmstart.cache_dir={tmp_path / 'cache'}",
        f"warmstart.data.source={pairs}", "warmstart.data.held_out=4", "eval.before=false", "eval.after=false"])
    with pytest.raises(ConfigError, match="no train prompt fits max_model_len=8"):
        prepare(cfg)
    assert not (tmp_path / "cache").exists()


def test_an_engine_thread_failure_is_reported_not_swallowed(tiny_model_factory):
    # Catches: an exception in a worker's engine thread (here a real one: a prompt longer than the
    # engine's max_model_len reaches the engine, as a dataset the up-front filter did not see would)
    # killing the thread silently, so the driver waits for groups that never come. The error must
    # show in status() (which the driver's health check turns into a RunError naming the worker) and
    # in every blocked call. Planted by catching and dropping the exception in RolloutWorker._guard,
    # status().error stays None and evaluate() blocks (the test times out).
    import queue as std_queue

    from sliderl.cluster.actors.rollout_worker import RolloutWorker
    from sliderl.cluster.records import Problem, PromptGroup
    from sliderl.rewards import RewardSpec
    from sliderl.rollout import EngineArgs, SamplingParams

    worker = RolloutWorker(0, str(tiny_model_factory("qwen3")), 0, EngineArgs(num_blocks=64, max_model_len=16),
                           SamplingParams(max_tokens=4), RewardSpec(), "arith", std_queue.Queue())
    try:
        worker.submit([PromptGroup("g00000000", Problem("p0", "x" * 40, "1"), 2, 7)])
        with pytest.raises(RuntimeError, match=r"(?s)rollout worker 0 stopped: Traceback.*does not fit max_model_len=16"):
            worker.evaluate(["1 + 1 ="], SamplingParams(max_tokens=2))
        assert "max_model_len" in worker.status().error
    finally:
        worker.stop()
