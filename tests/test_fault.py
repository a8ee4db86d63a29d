"""Failures on a real local Ray: a rollout worker killed mid-run (its groups re-issued, none trained
twice), a run stopped after a checkpoint and resumed to the same final step, a learner killed
mid-run (recreated from its last checkpoint), and a resume past a damaged newest checkpoint. One Ray
instance serves the module.
"""

import json
import os
import signal
from collections import Counter

import pytest
from cluster_jobs import (  # noqa: F401 (fixtures)
    expected_actor_name,
    logged_traces,
    metric_rows,
    model_dir,
    ray_session,
    tiny_job,
    tiny_overrides,
)


@pytest.fixture(scope="module")
def killed_worker_run(ray_session, model_dir, tmp_path_factory):
    """Async, one worker; SIGKILL its process after the first step at which it holds groups (long
    completions make that step 1); 4 steps in all."""
    from sliderl.cluster.run.driver import train

    seen = {}

    def kill_worker(session, step, metrics):
        if "pid" not in seen and step < 4:
            status = ray_session.get(session.pool.handles[0].status.remote())
            if status.held_group_ids:
                seen["pid"], seen["held"] = status.pid, status.held_group_ids
                os.kill(status.pid, signal.SIGKILL)
        if step == 4:
            seen["pid_after"] = ray_session.get(session.pool.handles[0].status.remote()).pid
            named = ray_session.get_actor(expected_actor_name(run_dir, "rollout-0"))
            seen["pid_by_name"] = ray_session.get(named.status.remote()).pid

    run_dir = tmp_path_factory.mktemp("fault") / "run"
    cfg = tiny_job(model_dir, run_dir, "train.mode=async", "train.steps=4",
                   "train.max_staleness=10", "rollout.max_inflight_groups=4", "rollout.max_restarts=2",
                   "sampling.max_tokens=48", "sampling.stop_token_ids=[]")
    return train(cfg, on_step=kill_worker), seen


def test_killed_worker_is_restarted_and_its_groups_reissued(killed_worker_run):
    result, seen = killed_worker_run
    state = result.state
    assert state.step == 4 and state.worker_restarts == 1
    assert seen["pid_after"] != seen["pid"]  # a new process took the worker's place
    # Catches: a restarted worker that loses its dashboard name (named per process, or not at all).
    # Planted by dropping "name" from cluster.actors.placement.actor_options, get_actor fails in the run.
    assert seen["pid_by_name"] == seen["pid_after"]
    assert seen.get("held") and set(seen["held"]) <= set(state.ledger.reissued)


def test_every_logged_group_is_trained_exactly_once(killed_worker_run):
    result, seen = killed_worker_run
    trained = result.state.ledger.trained
    assert len(trained) == 4 * 2 and all(n == 1 for n in Counter(trained).values())
    traces = logged_traces(result.run_dir)
    assert {t["group_id"] for t in traces} == set(trained)  # max_staleness 10: nothing was dropped
    # the groups the dead worker held (and that got trained) were sampled by its new process
    first_incarnation = {t["trace_id"].rsplit(".", 1)[1] for t in traces if t["group_id"] == trained[0]}
    redone = [t for t in traces if t["group_id"] in seen["held"]]
    assert redone and all(t["trace_id"].rsplit(".", 1)[1] not in first_incarnation for t in redone)
    rows = metric_rows(result.run_dir)
    assert rows[4]["worker_restarts"] == 1 and rows[4]["reissued_groups"] >= len(seen["held"])


@pytest.fixture(scope="module")
def resumed_runs(ray_session, model_dir, tmp_path_factory):
    """Run A stops after step 3 (checkpoints every 2 steps, so the last is step 2); run B resumes it to
    step 4, and its learner is killed after step 3 (B recreates it from the step-2 checkpoint)."""
    from sliderl.cluster.run.driver import train

    run_dir = tmp_path_factory.mktemp("resume") / "run"
    args = ("train.mode=sync", "train.steps=4", "checkpoint.every=2")
    first = train(tiny_job(model_dir, run_dir, *args), on_step=lambda session, step, metrics: step < 3)
    kills, by_name = [], []

    def kill_learner(session, step, metrics):
        named = ray_session.get_actor(expected_actor_name(run_dir, "learner"))
        by_name.append((ray_session.get(named.pid.remote()), ray_session.get(session.learner.pid.remote())))
        if step == 3 and not kills:
            kills.append(ray_session.get(session.learner.pid.remote()))
            os.kill(kills[0], signal.SIGKILL)

    second = train(tiny_job(model_dir, run_dir, *args, "resume=true"), on_step=kill_learner)
    return first, second, kills, by_name


def test_resume_continues_to_the_same_final_step(resumed_runs):
    first, second, _, _ = resumed_runs
    assert first.stopped_early and first.state.step == 3
    assert sorted(p.name for p in (first.run_dir / "checkpoints").iterdir()) == ["step_000002", "step_000004"]
    assert second.state.step == 4 and (second.run_dir / "checkpoints" / "step_000004" / "COMPLETE").is_file()
    assert sorted(metric_rows(second.run_dir)) == [1, 2, 3, 4]
    trained = second.state.ledger.trained
    assert len(trained) == 4 * 2 and len(set(trained)) == len(trained)
    # the first 2 steps' groups come from the checkpoint, unchanged
    assert trained[:4] == first.state.ledger.trained[:4]


def test_learner_crash_resumes_from_the_last_checkpoint(resumed_runs):
    _, second, kills, by_name = resumed_runs
    assert len(kills) == 1 and second.state.learner_restarts == 1
    # Catches: a resumed run, or a learner recreated from its checkpoint, whose actor cannot take (or does
    # not keep) the run's name: every step of run B finds its current learner by name, the recreated one too.
    # Planted by dropping "name" from cluster.actors.placement.actor_options, get_actor fails in run B.
    assert by_name and all(named == current for named, current in by_name), by_name
    assert by_name[-1][1] != kills[0]  # the last step's learner is the recreated one
    assert second.state.step == 4 and second.state.version == sum(
        int(r["learner/stepped"]) for r in metric_rows(second.run_dir).values())


def test_resumed_runs_log_each_trained_group_once(resumed_runs):
    # Catches (issue 11, bug 6): after a stop + resume (and a learner restart from the step-2
    # checkpoint), the groups logged after that checkpoint were generated and logged again, so the
    # trace log held them twice. The log is rolled back to the checkpoint on resume. Planted by
    # skipping the rollback, groups of step 3 appear 8 times instead of 4.
    _, second, _, _ = resumed_runs
    trained = second.state.ledger.trained
    counts = Counter(t["group_id"] for t in logged_traces(second.run_dir))
    assert set(counts) == set(trained) and set(counts.values()) == {4}, counts


def test_resumed_runs_log_each_step_once_in_metrics_jsonl(resumed_runs):
    # Catches (issue 37): metrics.jsonl holding the rows of steps rolled back (run A's step 3, then run B's step
    # 3 before its learner died) beside the replayed ones: 1, 2, 3, 3, 3, 4. Every line is read, not merged by
    # step. Planted by not rolling metrics.jsonl back in resume.roll_back, steps 3 appear three times.
    _, second, _, _ = resumed_runs
    steps = [json.loads(line)["step"] for line in (second.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4], steps


@pytest.fixture(scope="module")
def kept_two_run(resumed_runs, model_dir):
    """Run C resumes run B (at step 4) to step 7 with a checkpoint every step and keep=2; the checkpoint
    folders right after it."""
    from sliderl.cluster.run.driver import train

    _, second, _, _ = resumed_runs
    third = train(tiny_job(model_dir, second.run_dir, "train.mode=sync", "train.steps=7", "checkpoint.every=1",
                           "checkpoint.keep=2", "resume=true"))
    folders = sorted(p.name for p in (second.run_dir / "checkpoints").iterdir())
    return third, folders, (second.run_dir / "checkpoints" / "step_000007" / "COMPLETE").is_file()


def test_a_resumed_run_keeps_checkpointing_after_pruning_its_source(kept_two_run):
    # Catches (issue 11, bug 1, at the cluster level): the learner resumed from step_000004 read that
    # folder's config at every save; with checkpoint.every=1 and keep=2 the folder is pruned after the
    # step-6 save, and the step-7 save failed ("model path ... does not exist"), leaving it incomplete.
    third, folders, step7_complete = kept_two_run
    assert third.state.step == 7
    assert folders == ["step_000006", "step_000007"] and step7_complete


def test_resume_falls_back_past_a_damaged_newest_checkpoint(kept_two_run, model_dir, capsys):
    # Catches (issue 11, bug 5, through the driver): with step_000007's model.safetensors truncated,
    # resume=true picked step_000007 anyway; the learner failed to load it, was restarted on the same
    # checkpoint, and the run ended with "restarts are used up" although step_000006 was intact.
    # Planted by latest() without the manifest check, train() raises RunError.
    from sliderl.cluster.run.driver import train
    from sliderl.trainer.manifest import Manifest

    third, _, _ = kept_two_run
    checkpoints = third.run_dir / "checkpoints"
    weights = checkpoints / "step_000007" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    capsys.readouterr()
    fourth = train(tiny_job(model_dir, third.run_dir, "train.mode=sync", "train.steps=8", "checkpoint.every=1",
                            "checkpoint.keep=2", "resume=true"))
    warning = capsys.readouterr().err
    assert "checkpoint step_000007 is damaged and skipped" in warning and str(weights) in warning, warning
    assert fourth.state.step == 8 and fourth.state.learner_restarts == 0
    assert fourth.state.ledger.trained[:6 * 2] == third.state.ledger.trained[:6 * 2]  # step 6's books, kept
    assert len(fourth.state.ledger.trained) == 8 * 2 and len(set(fourth.state.ledger.trained)) == 8 * 2
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_000007", "step_000007.damaged", "step_000008"]
    for step in ("step_000007", "step_000008"):  # the re-done step 7 and step 8 are intact
        assert Manifest.read(checkpoints / step).damage(checkpoints / step) is None


def test_a_resume_with_no_steps_left_exits_0(kept_two_run, model_dir, capsys):
    # Catches (issue 37): a resumed run whose remaining steps were all taken before it stopped exited 1 with "no
    # optimizer step was taken" (the driver counted only its own process's steps). `sliderl train resume=true` at
    # the run's last complete step has nothing to do and succeeds. Planted by counting this session's versions
    # again (version - start_version), it exits 1.
    from sliderl.cluster.cli import main
    from sliderl.cluster.run.checkpoints import Checkpoints

    third, _, _ = kept_two_run
    last = Checkpoints(third.run_dir).complete()[-1]  # step 7, or 8 after the fallback test
    step = int(last.name.removeprefix("step_"))
    code = main(["train", *tiny_overrides(model_dir, third.run_dir), "train.mode=sync", f"train.steps={step}",
                 "checkpoint.every=1", "checkpoint.keep=2", "resume=true"])
    err = capsys.readouterr().err
    assert code == 0 and "no optimizer step" not in err, err[-2000:]
