"""One run per run_dir, and a resume that continues the same run (issue 37): a second driver on a live run is
refused before it touches anything; a resume that would change what the run is is refused, one that changes
how it goes on is said and kept in the config's history; the folders a run writes are checked before Ray."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from cluster_jobs import tiny_overrides

from sliderl.cluster.cli import main
from sliderl.cluster.config.base import load_config
from sliderl.cluster.config.train import TrainConfig
from sliderl.cluster.errors import ConfigError
from sliderl.cluster.run.checkpoints import Checkpoints, DriverState
from sliderl.cluster.run.lock import RunDirInUse, RunLock
from sliderl.cluster.run.plan import prepare
from sliderl.cluster.run.resume import HISTORY_FILE, roll_back_metrics
from sliderl.cluster.storage.root import Storage
from sliderl.trainer.manifest import Manifest

ROOT = Path(__file__).resolve().parents[1]


def hold_lock_in_another_process(run_dir: Path) -> subprocess.Popen:
    """A process that takes the run's lock as a driver does, says so, and waits to be killed."""
    code = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(ROOT)!r})
        from sliderl.cluster.run.lock import RunLock
        from sliderl.cluster.storage.root import Storage
        lock = RunLock.acquire(Storage({str(run_dir)!r}))
        print("held", flush=True)
        time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_driver_on_a_live_run_is_refused_before_it_touches_anything(tiny_model_factory, tmp_path, capsys):
    # Catches (issue 37): a second `sliderl train --resume` on a run whose driver was alive rolled the trace log
    # back under it (1,020 of 6,000 trained groups' traces deleted). The second driver gets one line naming the
    # live one (host, pid), exit 2, before Ray and before it reads a checkpoint or the trace log; once the
    # holder dies (SIGKILL: no cleanup of any kind) the lock is free. Planted by not taking the lock in
    # plan.prepare, the second driver goes on (here: to "holds no complete checkpoint") and this fails.
    import ray

    model = tiny_model_factory("qwen3")
    capsys.readouterr()  # building the model prints its progress
    run_dir = tmp_path / "run"
    (run_dir / "traces").mkdir(parents=True)
    part = run_dir / "traces" / "part-000000.parquet"
    part.write_bytes(b"the live run's traces")
    holder = hold_lock_in_another_process(run_dir)
    try:
        code = main(["train", *tiny_overrides(model, run_dir), "resume=true"])
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1, err
        assert f"run_dir '{run_dir}' is in use by a live run (host {os.uname().nodename}, pid {holder.pid}" in err, err
        assert part.read_bytes() == b"the live run's traces" and not ray.is_initialized()
        with pytest.raises(RunDirInUse):  # the same holds within one process: flock is per open file
            RunLock.acquire(Storage(run_dir))
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=60)
    RunLock.acquire(Storage(run_dir)).release()  # the dead holder's lock went with it


def test_the_lock_is_released_when_the_run_ends_and_when_prepare_fails(tiny_model_factory, tmp_path):
    # Catches: a lock kept after the run (a resume in the same process, as the learner-restart and resume
    # tests do, would be refused) or after a check that failed. Planted by dropping the release in
    # RunPlan.finish, the second prepare raises RunDirInUse.
    run_dir = tmp_path / "run"
    base = tiny_overrides(tiny_model_factory("qwen3"), run_dir)
    plan = prepare(load_config(TrainConfig, None, base))
    plan.finish()
    with pytest.raises(ConfigError, match="resume=true but"):  # fails after taking the lock
        prepare(load_config(TrainConfig, None, [*base, "resume=true"]))
    prepare(load_config(TrainConfig, None, base)).finish()


def saved_run(tiny_model_factory, tmp_path, *overrides) -> tuple[Path, list[str]]:
    """A run directory as a first session leaves it: config.yaml from prepare, a checkpoint at step 1."""
    run_dir = tmp_path / "run"
    base = tiny_overrides(tiny_model_factory("qwen3"), run_dir) + list(overrides)
    prepare(load_config(TrainConfig, None, base)).finish()
    Checkpoints(run_dir).save(1, DriverState(step=1, version=1, cursor=2), lambda path: Manifest())
    return run_dir, base


def test_a_resume_that_changes_what_the_run_is_is_refused_naming_every_key(tiny_model_factory, tmp_path, capsys):
    # Catches (issue 37): a resume with a group size of 4 over a run of 8 accepted silently (config.yaml
    # overwritten, two group sizes in one run). Planted by not comparing (check_resumed_config returning no
    # change), the resume goes on and this fails.
    run_dir, base = saved_run(tiny_model_factory, tmp_path)
    capsys.readouterr()
    before = (run_dir / "config.yaml").read_text()
    code = main(["train", *base, "resume=true", "rollout.group_size=8", "engine.kv=prefix_sliding:16",
                 "learner.algo.type=bonbon", "learner.algo.speedup_key=null", "train.steps=5"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    for change in ('engine.kv: "prefix_sliding:8" -> "prefix_sliding:16"', "rollout.group_size: 4 -> 8",
                   'learner.algo.type: "grpo" -> "bonbon"', "learner.vocab_policy"):
        assert change in err, err
    assert "train.steps" not in err  # an allowed change is not among the refused ones
    assert (run_dir / "config.yaml").read_text() == before


def test_a_resume_that_changes_how_the_run_goes_on_is_said_and_kept_in_the_history(tiny_model_factory, tmp_path,
                                                                                      capsys):
    # Catches (issue 37): config.yaml silently overwritten by a resume. The allowed changes (steps, eval,
    # workers) are printed; config.yaml is the new config and config_history.yaml holds both sessions'. A
    # default made of the time (eval.compare.output_dir, unused by a train job) is no change. Planted by writing
    # config.yaml without the history, this fails.
    run_dir, base = saved_run(tiny_model_factory, tmp_path)
    plan = prepare(load_config(TrainConfig, None, [*base, "resume=true", "train.steps=5", "eval.after=true",
                                                   "rollout.num_workers=2"]))
    plan.finish()
    out = capsys.readouterr().out
    assert ("resume changes eval.after: false -> true; learner.total_steps: 3 -> 5; rollout.num_workers: 1 -> 2; "
            "train.steps: 3 -> 5") in out, out  # (learner.total_steps follows train.steps)
    assert plan.resume[0].name == "step_000001"
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["train"]["steps"] == 5
    sessions = list(yaml.safe_load_all((run_dir / HISTORY_FILE).read_text()))
    assert [s["train"]["steps"] for s in sessions] == [3, 5]
    history = (run_dir / HISTORY_FILE).read_text()
    assert ": started\n" in history and ": resumed from step_000001, changing eval.after, learner.total_steps, " \
                                        "rollout.num_workers, train.steps\n" in history


@pytest.mark.parametrize("blocked", ["checkpoints", "traces"])
def test_a_file_where_the_run_keeps_a_folder_is_exit_2_before_ray(tiny_model_factory, tmp_path, blocked, capsys):
    # Catches (issue 37): a checkpoint folder that cannot be written found only at the first save, as a
    # traceback mid-run. (A read-only folder is refused the same way, by the probe write; the tests run as root,
    # for whom no folder is read-only.) Planted by dropping check_run_folders from plan._open_run, Ray starts.
    model = tiny_model_factory("qwen3")
    capsys.readouterr()
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / blocked).write_text("")
    code = main(["train", *tiny_overrides(model, run_dir)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert f"{run_dir / blocked} is a file where the run keeps a folder" in err, err


def test_metrics_rows_after_the_checkpoint_are_rolled_back(tmp_path):
    # Catches (issue 37): a resumed run's metrics.jsonl holding steps 3 and 4 twice (the first session's, then
    # the replayed ones). Rows up to the checkpoint's step stay byte for byte; later ones (and a line cut short
    # by a crash) go.
    path = tmp_path / "metrics.jsonl"
    rows = ['{"step": 1, "reward": 0.5}', '{"step": 2, "reward": 0.25}', '{"step": 3, "reward": 1.0}',
            '{"step": 4, "rew']
    path.write_text("\n".join(rows))
    assert roll_back_metrics(path, 2) == 2
    assert path.read_text() == rows[0] + "\n" + rows[1] + "\n"
    assert roll_back_metrics(path, 2) == 0 and roll_back_metrics(tmp_path / "none.jsonl", 2) == 0


def test_a_failed_save_stops_naming_the_write_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    # Catches (issue 37): a checkpoint write that fails mid-run (here the disk is full when step_000002's
    # driver_state.json is written) giving a traceback, or leaving a folder behind. The save raises; failed_save
    # removes the half-written folder and stops the run (checkpoint.on_error=stop, the default) naming the file
    # and the checkpoint a resume picks, which is step_000001. Planted by not removing the folder, a
    # step_000002 without its marker stays.
    from sliderl.cluster.errors import RunError
    from sliderl.cluster.run.guards import failed_save

    checkpoints = Checkpoints(tmp_path)
    checkpoints.save(1, DriverState(step=1), lambda path: Manifest())
    write_bytes = Storage.write_bytes

    def full_disk(self, path, data):
        if path.name == "driver_state.json" and path.parent.name == "step_000002":
            raise OSError(28, "No space left on device", str(path))
        return write_bytes(self, path, data)

    monkeypatch.setattr(Storage, "write_bytes", full_disk)
    with pytest.raises(OSError) as raised:
        checkpoints.save(2, DriverState(step=2), lambda path: Manifest())
    with pytest.raises(RunError, match=r"checkpoint step_000002 could not be written \(writing \S*step_000002/"
                                       r"driver_state.json failed: No space left on device\); the previous "
                                       r"checkpoint step_000001 is intact \(resume=true continues from it\)"):
        failed_save(checkpoints, 2, raised.value, "stop", tmp_path)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000001"]
    assert checkpoints.latest()[0].name == "step_000001"
