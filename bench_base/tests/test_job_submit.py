"""``ray job submit`` against a ``ray start --head`` cluster on 127.0.0.1: a short training job
succeeds and leaves its checkpoint, Parquet traces and metrics behind.

The cluster is started in its own session with its own temp dir (so no other ``ray.init`` on the
machine finds it), token authentication with a token made here, and free ports. It is stopped by
terminating the processes of that session one pid at a time — only what this test started.
"""

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from cluster.config import to_yaml
from cluster_jobs import metric_rows, tiny_job

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def session_pids(sid: int) -> list[int]:
    """Processes (still running) of the session ``sid``."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.getsid(int(entry)) == sid:
                    pids.append(int(entry))
            except OSError:  # exited meanwhile
                pass
    return pids


def stop_session(sid: int, grace_s: float = 5.0) -> list[int]:
    """SIGTERM every process of the session by pid, SIGKILL what is left after ``grace_s``."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        for pid in session_pids(sid):
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        deadline = time.monotonic() + wait_s
        while session_pids(sid) and time.monotonic() < deadline:
            time.sleep(0.2)  # polling /proc for exits: there is no event to wait on
    return session_pids(sid)


@pytest.fixture
def ray_cluster():
    """``ray start --head`` on 127.0.0.1 with 2 CPUs; yields (dashboard url, env); stopped afterwards."""
    gcs, dashboard, client, agent = free_ports(4)
    temp_dir = tempfile.mkdtemp(prefix="srj", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(16), PATH=f"{BIN}:{env.get('PATH', '')}",
               HF_HUB_OFFLINE="1")
    start = subprocess.Popen(
        [str(BIN / "ray"), "start", "--head", f"--port={gcs}", "--node-ip-address=127.0.0.1", "--num-cpus=2",
         "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard}", f"--ray-client-server-port={client}",
         f"--dashboard-agent-listen-port={agent}", f"--temp-dir={temp_dir}", "--disable-usage-stats"],
        env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = start.communicate(timeout=180)
        assert start.returncode == 0, out[-3000:]
        yield f"http://127.0.0.1:{dashboard}", env
    finally:
        left = stop_session(start.pid)
        shutil.rmtree(temp_dir, ignore_errors=True)
        assert not left, f"processes of the test cluster still running: {left}"


def test_job_submit_trains_and_writes_its_outputs(ray_cluster, tiny_model_factory, tmp_path):
    address, env = ray_cluster
    run_dir = tmp_path / "run"
    cfg = tiny_job(tiny_model_factory("qwen3"), run_dir, "train.mode=async", "train.steps=2")
    config_file = tmp_path / "tiny.yaml"
    config_file.write_text(to_yaml(cfg))
    job = subprocess.run(
        [str(BIN / "ray"), "job", "submit", f"--address={address}", "--working-dir", ".", "--",
         "sliderl", "train", str(config_file), "monitor.wandb.mode=offline"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=480)
    output = job.stdout + job.stderr
    assert job.returncode == 0 and "succeeded" in output, output[-4000:]
    assert (run_dir / "checkpoints" / "step_000002" / "COMPLETE").is_file()
    assert (run_dir / "checkpoints" / "step_000002" / "config.json").is_file()
    assert list((run_dir / "traces").glob("part-*.parquet"))
    assert sorted(metric_rows(run_dir)) == [1, 2]
    assert (run_dir / "summary.txt").is_file() and (run_dir / "wandb").is_dir()
    assert "cannot reach" not in output and "Started a local Ray instance" not in output  # it joined the cluster
