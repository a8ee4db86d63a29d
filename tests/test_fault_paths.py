"""The ways a run ends or recovers that a user's cluster produces, each injected for real on a local Ray:
a learner killed with no checkpoint, learner restarts used up, a hung worker (no group before
``group_timeout_s``), every worker dead, a diverged learner (non-finite loss), delayed weight
sync (``sync_every`` 2), and a broadcast that fails and is published again (on the WeightSync with
real actors). One Ray instance serves
the module; each run is a few tiny steps.
"""

from __future__ import annotations

import os
import re
import signal

import pytest
from cluster_jobs import logged_traces, metric_rows, model_dir, ray_session, tiny_job  # noqa: F401 (fixtures)

from sliderl.cluster.errors import RunError

WEIGHT = "model.layers.0.mlp.down_proj.weight"


def kill_learner_at(ray_session, steps: set[int], kills: list[int]):
    """An on_step hook that SIGKILLs the learner's process after each step in ``steps`` (once per step)."""
    def hook(session, step, report):
        if step in steps and step not in {s for s, _ in kills}:
            pid = ray_session.get(session.learner.pid.remote())
            kills.append((step, pid))
            os.kill(pid, signal.SIGKILL)
    return hook


def test_a_learner_lost_without_a_checkpoint_ends_the_run_and_keeps_its_traces(ray_session, model_dir, tmp_path):
    # Catches: a learner death with nothing to resume from crashing on `None[0]` (or hanging)
    # instead of a RunError that says so and leaves the trace log. Planted by dropping the
    # `latest is None` test in driver._sessions, this fails with a TypeError.
    from sliderl.cluster.run.driver import train

    kills: list = []
    cfg = tiny_job(model_dir, tmp_path / "run", "train.mode=sync", "train.steps=3", "checkpoint.every=0")
    with pytest.raises(RunError, match=r"the learner died \(.*\) and no intact checkpoint exists"):
        train(cfg, on_step=kill_learner_at(ray_session, {1}, kills))
    assert len(kills) == 1
    assert {t["group_id"] for t in logged_traces(tmp_path / "run")}  # the traces of step 1 are on disk


def test_learner_restarts_used_up_end_the_run_with_the_checkpoints_intact(ray_session, model_dir, tmp_path):
    # Catches: an off-by-one in train.max_learner_restarts (a third learner started, or the first
    # restart refused). Killed after step 1 and again after the replayed step 2 with one restart
    # allowed: the first death resumes from step_000001, the second ends the run. Planted with
    # `restarts > max_learner_restarts`, the run restarts twice and finishes; with `>=` replaced
    # by `>= max - 1`... the first death already ends it (the kills list then has one entry).
    from sliderl.cluster.run.checkpoints import Checkpoints
    from sliderl.cluster.run.driver import train

    kills: list = []
    cfg = tiny_job(model_dir, tmp_path / "run", "train.mode=sync", "train.steps=4", "checkpoint.every=1",
                   "checkpoint.keep=3", "train.max_learner_restarts=1")
    with pytest.raises(RunError, match=r"the learner died \(.*\) and its restarts are used up"):
        train(cfg, on_step=kill_learner_at(ray_session, {1, 2}, kills))
    assert [step for step, _ in kills] == [1, 2] and kills[0][1] != kills[1][1]
    latest = Checkpoints(tmp_path / "run", keep=3).latest()
    assert latest is not None and latest[1].step == 2 and latest[1].learner_restarts == 1


def test_an_actor_whose_init_raised_is_reported_by_its_exception(ray_session):
    # catches: "the learner died (...)" (and "rollout worker N is gone for good: ...") cutting the actor's
    # creation-task traceback at 300 characters, so the exception that says why never reaches the user (the
    # learner's host-memory refusal is ~300 characters on its own). Planted by returning the 300-character
    # slice for init failures too, the message lacks the exception's tail and this fails.
    from sliderl.cluster.errors import actor_death

    class RefusesToStart:  # defined here: Ray ships it by value (the workers cannot import this test module)
        def __init__(self, message: str):
            raise ValueError(message)  # as a learner rank does when its node cannot hold the offloaded state

        def ping(self) -> int:
            return 1

    message = "learner.offload=cpu: " + "n" * 400 + " [the end]"
    actor = ray_session.remote(num_cpus=0)(RefusesToStart).remote(message)
    with pytest.raises(ray_session.exceptions.ActorDiedError) as died:
        ray_session.get(actor.ping.remote(), timeout=60)
    assert died.value.actor_init_failed
    assert actor_death(died.value) == f"its __init__ raised ValueError: {message}"


def test_a_hung_worker_ends_the_run_after_group_timeout(ray_session, model_dir, tmp_path):
    # Catches: a run that waits forever when no group arrives (a worker hung in a kernel, a stuck
    # verifier). The worker's process is stopped with SIGSTOP after step 1 (sync mode: step 2's groups
    # are dealt after that), so it answers neither groups nor health checks. Planted by never raising
    # in Session._collect, the run hangs (the test times out).
    from sliderl.cluster.run.driver import train

    stopped = []

    def stop_worker(session, step, report):
        if step == 1:
            stopped.append(ray_session.get(session.pool.handles[0].status.remote()).pid)
            os.kill(stopped[0], signal.SIGSTOP)

    cfg = tiny_job(model_dir, tmp_path / "run", "train.mode=sync", "train.steps=3", "train.group_timeout_s=8")
    try:
        with pytest.raises(RunError, match=r"no rollout group arrived for 8 s \(live workers: \[0\]\)"):
            train(cfg, on_step=stop_worker)
    finally:
        for pid in stopped:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:  # ended with the session
                pass
    assert stopped


def test_every_worker_dead_ends_the_run(ray_session, model_dir, tmp_path):
    # Catches: a run whose only worker is gone for good (restarts used up) waiting for the group
    # timeout, or dealing to a dead worker, instead of ending at once with the reason. Planted by
    # removing the `not self.pool.live()` check in Session._handle, the run ends only at
    # group_timeout_s with a different message and this fails.
    from sliderl.cluster.run.driver import train

    def kill_worker(session, step, report):
        if step == 1:
            os.kill(ray_session.get(session.pool.handles[0].status.remote()).pid, signal.SIGKILL)

    cfg = tiny_job(model_dir, tmp_path / "run", "train.mode=sync", "train.steps=3", "rollout.max_restarts=0",
                   "train.group_timeout_s=120")
    with pytest.raises(RunError, match=r"every rollout worker died \(restarts used up: rollout.max_restarts=0\)"):
        train(cfg, on_step=kill_worker)


def test_a_diverged_learner_ends_the_run_with_a_clear_error(ray_session, model_dir, tmp_path):
    # Catches: a non-finite loss or gradient surfacing as a Ray traceback from inside the actor (or
    # an optimizer step taken on NaN gradients). lr=1e30 makes the first Adam step blow the weights
    # up, so the next step's loss is not finite. Planted by removing the RayTaskError branch in
    # Session._train, a raw RayTaskError escapes and this fails.
    from sliderl.cluster.run.driver import train

    cfg = tiny_job(model_dir, tmp_path / "run", "train.mode=sync", "train.steps=4", "learner.lr=1e30",
                   "learner.max_grad_norm=1e30")
    with pytest.raises(RunError, match=r"learner step \d failed: FloatingPointError: (non-finite loss|gradient norm)"):
        train(cfg)
    assert metric_rows(tmp_path / "run")  # the steps before it were logged


def test_sync_every_2_publishes_every_other_step_and_the_last(ray_session, model_dir, tmp_path):
    # Catches: train.sync_every ignored (weights published after every step) or the last step's weights never
    # published. Async, sync_every=2, 5 steps, every step trains (kv_penalty gives every group reward variance):
    # versions 2, 4 and 5 are published (5: the last step, not a multiple of 2), never 1 or 3, so every trace was
    # sampled at version 0, 2 or 4, only steps 2, 4 and 5 report a weight-sync time, and after the run the worker
    # holds the learner's version-5 weights. Planted with `due = True`, step 1 has a sync time; with the last step
    # left out of `due` (issue 37: the suite let it through while its 4 steps were a multiple of the period),
    # step 5 has no sync and the worker stays at version 4.
    from sliderl.cluster.run.driver import train

    seen = {}

    def read_weights(session, step, report):
        if step == 5:
            seen["worker_version"] = ray_session.get(session.pool.handles[0].status.remote()).version
            seen["worker"] = ray_session.get(session.pool.handles[0].parameter.remote(WEIGHT))
            seen["learner"] = ray_session.get(session.learner.parameter.remote(WEIGHT))

    cfg = tiny_job(model_dir, tmp_path / "run", "train.mode=async", "train.steps=5", "train.sync_every=2",
                   "train.max_staleness=4", "rollout.max_inflight_groups=2")
    result = train(cfg, on_step=read_weights)
    rows = metric_rows(result.run_dir)
    assert result.state.version == 5, "every step should train (else the versions below are not 2, 4 and 5)"
    synced = [step for step, row in sorted(rows.items()) if row.get("weight_sync_seconds") is not None]
    assert synced == [2, 4, 5]
    versions = {t["policy_version"] for t in logged_traces(result.run_dir)}
    assert versions <= {0, 2, 4} and 2 in versions, versions
    assert seen["worker_version"] == 5 and seen["worker"] == seen["learner"]


def test_a_failed_broadcast_is_published_again(ray_session, model_dir, tmp_path):
    # Catches: a broadcast group left with a dead member, so every later publish fails (or hangs) and
    # a restarted worker stays fenced on its initial weights. Real actors and a real gloo group: after
    # a publish reached both workers, worker 1's process is SIGKILLed and Ray restarts it (fenced: no
    # work until it gets weights) without telling the WeightSync; the next broadcast then fails (its
    # rank is gone, the new process never joined) and is reported, and the one after rebuilds the
    # group and reaches both. The learner has not trained, so every publish is its version 0. Planted
    # by leaving `self._members` as it was after a failure (no rebuild), the third publish fails too
    # and worker 1 stays fenced.
    import time

    from sliderl.cluster.actors.learner_group import make_learner
    from sliderl.cluster.actors.placement import make_queue, release, reserve
    from sliderl.cluster.actors.rollout_worker import make_worker
    from sliderl.cluster.actors.weight_sync import WeightSync

    cfg = tiny_job(model_dir, tmp_path / "run", "rollout.num_workers=2", "rollout.num_cpus=0.25",
                   "learner.num_cpus=0.25", "weight_sync.backend=broadcast", "rollout.max_restarts=2")
    pg = reserve(cfg)
    queue = make_queue(cfg)
    learner = make_learner(cfg, pg, str(model_dir))
    workers = {w: make_worker(cfg, pg, w, str(model_dir), 0, queue) for w in range(2)}
    try:
        first = ray_session.get(workers[1].status.remote())
        sync = WeightSync("broadcast", "gloo", "cpu", timeout_s=8)
        assert sync.publish(0, learner, workers).failed == []
        os.kill(first.pid, signal.SIGKILL)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # Ray restarts the process: wait for the new incarnation
            try:
                if ray_session.get(workers[1].status.remote(), timeout=5).incarnation != first.incarnation:
                    break
            except Exception:  # restarting
                time.sleep(0.5)
        assert ray_session.get(workers[1].status.remote()).fenced  # restarted: waits for weights
        assert 1 in sync.publish(0, learner, workers).failed  # the old group has a dead rank
        assert sync.publish(0, learner, workers).failed == []  # a new group, both workers in it
        assert not ray_session.get(workers[1].status.remote()).fenced
        learner_weight = ray_session.get(learner.parameter.remote(WEIGHT))
        assert all(ray_session.get(w.parameter.remote(WEIGHT)) == learner_weight for w in workers.values())
    finally:
        learner.kill()
        for actor in [queue.actor, *workers.values()]:
            ray_session.kill(actor, no_restart=True)
        release(pg)


def test_a_checkpoint_the_learner_cannot_write_is_named_and_left_out(ray_session, model_dir, tmp_path, monkeypatch,
                                                                      capsys):
    # Catches (issue 37): a checkpoint that cannot be written (full or read-only disk, a path that is a file) ending
    # the run with a traceback mid-run, or leaving a half-written folder. Here the learner's own write fails for
    # real: step_000002's model.safetensors is a folder when the learner opens it (IsADirectoryError inside the
    # actor). The driver names the write, removes the half-written step_000002, and with checkpoint.on_error=
    # continue goes on to step 3, whose checkpoint is complete (the default, stop, is
    # tests/test_run_dir.py::test_a_failed_save_stops_naming_the_write_and_keeps_the_previous_checkpoint). Planted
    # by dropping the except in Session._checkpoint, a raw RayTaskError escapes and this fails.
    from sliderl.cluster.run.driver import train
    from sliderl.cluster.storage.root import Storage

    make_dir = Storage.make_dir

    def blocked_weights(self, path):
        make_dir(self, path)
        if path.name == "step_000002":
            (path / "model.safetensors").mkdir()

    monkeypatch.setattr(Storage, "make_dir", blocked_weights)
    cfg = tiny_job(model_dir, tmp_path / "run", "train.mode=sync", "train.steps=3", "checkpoint.every=1",
                   "checkpoint.keep=3", "checkpoint.on_error=continue")
    result = train(cfg)
    assert result.state.step == 3
    err = capsys.readouterr().err
    assert re.search(r"checkpoint step_000002 could not be written \(writing \S*step_000002/model.safetensors failed: "
                     r"Is a directory\); the previous checkpoint step_000001 is intact; the run goes on", err), err
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["step_000001", "step_000003"]


def test_groups_that_keep_arriving_too_stale_end_the_run(ray_session, model_dir, tmp_path, monkeypatch):
    # Catches (issue 37): a run that spins forever when every group that arrives is too stale to train (the group
    # timeout never fires while groups keep arriving). Here no weights ever reach the workers (publish does
    # nothing), so after step 1 every group is sampled at version 0 while the learner is at 1, one version too
    # old for max_staleness 0. This is also what a worker that never updates its weight version does (a bug that
    # made this suite's sync test hang): the run ends naming staleness, groups in flight and the step time.
    # Planted by never raising in Session._collect, the run spins until the test's timeout.
    from sliderl.cluster.actors.weight_sync import SyncReport, WeightSync
    from sliderl.cluster.run.driver import train

    monkeypatch.setattr(WeightSync, "publish", lambda self, version, learner, workers: SyncReport(version, 0.0, []))
    cfg = tiny_job(model_dir, tmp_path / "run", "train.mode=async", "train.steps=3", "train.max_staleness=0",
                   "rollout.max_inflight_groups=2", "train.max_stale_streak=6")
    # The streak passes the limit of 6 at 7, or at 8 when the last two dropped groups arrive in one take (the
    # count is of groups, and with 2 in flight a take holds at most two: seen once in a full-suite run), never later.
    with pytest.raises(RunError, match=r"[78] groups in a row arrived too stale to train \(the last sampled at version "
                                       r"0, the learner at 1; train.max_staleness=0\) with \d+ groups \(1 workers x "
                                       r"rollout.max_inflight_groups=2\) in flight and a mean learner step of "
                                       r"\d+\.\d s"):
        train(cfg)
