"""Ctrl-C on a training job: a clean exit (130, one line, no traceback) and nothing already written is lost."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cluster_jobs import tiny_overrides
from cluster.run_checkpoints import MARKER

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_ctrl_c_exits_130_in_one_line_and_keeps_the_checkpoints(tiny_model_factory, tmp_path):
    # Catches: a SIGINT (a user's Ctrl-C, or tip_seeds' time box) ending `sliderl train` in a KeyboardInterrupt
    # traceback, or a cleanup on the way out that removes what the run wrote. A real job on its own local Ray
    # instance is interrupted once its first complete checkpoint is on disk. Planted by dropping the CLI's
    # KeyboardInterrupt handler: Python's default ends the process by the signal (returncode -2), and this fails.
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "cluster.cli", "train", *tiny_overrides(tiny_model_factory("qwen3"), run),
           "train.steps=10000", "checkpoint.every=1", "ray.num_cpus=2", "train.mode=sync"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    deadline = time.time() + 240
    while not list(run.glob(f"checkpoints/step_*/{MARKER}")) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.5)
    assert proc.poll() is None, proc.communicate()[1][-3000:]
    assert list(run.glob(f"checkpoints/step_*/{MARKER}")), "no checkpoint within 240 s"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert err.strip().splitlines()[-1] == ("sliderl train: interrupted; what it wrote so far (checkpoints, traces, "
                                            "metrics) is kept")
    assert list(run.glob(f"checkpoints/step_*/{MARKER}")) and (run / "metrics.jsonl").is_file()
