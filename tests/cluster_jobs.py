"""Shared set-up of the Ray integration tests: a tiny training job and readers of what it wrote.

The job: a random tiny Qwen3, the arithmetic task with 2-3 step problems, 16-token completions
that stop at any byte divisible by 8 (so lengths vary), and a reward with a small KV penalty on
top of correctness, so GRPO groups differ in reward and the learner actually steps.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from sliderl.cluster.actors.placement import start_local_ray
from sliderl.cluster.config.base import load_config
from sliderl.cluster.config.train import TrainConfig

STOP_IDS = list(range(0, 256, 8))


def tiny_overrides(model_dir: Path, run_dir: Path) -> list[str]:
    return [
        "warmstart.enabled=false", "model.type=hf", f"model.path={model_dir}", f"run_dir={run_dir}",
        "task.num_steps=[2,3]", "task.train_size=64", "task.eval_size=4", "eval.num_problems=4",
        "sampling.max_tokens=16", f"sampling.stop_token_ids={json.dumps(STOP_IDS)}",
        "engine.kv=prefix_sliding:8", "engine.num_blocks=256", "engine.max_num_batched_tokens=512",
        "reward={correctness: 1.0, kv_penalty: {budget: 1, weight: 0.01}}",
        "train.steps=3", "train.groups_per_step=2", "rollout.num_workers=1", "rollout.group_size=4", "learner.lr=0.01",
        "monitor.wandb.mode=disabled", "monitor.include_dashboard=false", "monitor.plots=false",
        "eval.before=false", "eval.after=false", "checkpoint.every=0", "train.health_check_s=0.5",
    ]


def tiny_job(model_dir: Path, run_dir: Path, *overrides: str) -> TrainConfig:
    """The tiny job with ``overrides`` (``key=value``) applied on top."""
    return load_config(TrainConfig, None, tiny_overrides(model_dir, run_dir) + list(overrides))


def expected_actor_name(run_dir: Path, role: str) -> str:
    """A run's actor name as docs/guide.md states it: ``<last part of run_dir>-<first 6 hex digits of the sha256 of
    the absolute run_dir>/<role>``, worked out here without sliderl's code."""
    root = str(Path(run_dir).resolve())
    return f"{Path(root).name}-{hashlib.sha256(root.encode()).hexdigest()[:6]}/{role}"


def metric_rows(run_dir: Path) -> dict[int, dict]:
    """metrics.jsonl by step (a replayed step keeps its latest row)."""
    rows = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        rows[row["step"]] = row
    return rows


def logged_traces(run_dir: Path) -> list[dict]:
    """Every row of the Parquet trace log (group id, trace id, version, worker, tokens)."""
    from sliderl.cluster.storage.trace_log import TraceLog

    columns = ["group_id", "trace_id", "policy_version", "worker_id", "completion_token_ids", "reward", "num_preemptions"]
    return TraceLog(run_dir).read(columns).to_pylist()


def initial_weight(model_dir: Path, name: str) -> list[float]:
    """A weight as saved in the model directory (read with safetensors, not through sliderl)."""
    from safetensors import safe_open

    with safe_open(str(Path(model_dir) / "model.safetensors"), framework="pt") as f:
        return f.get_tensor(name).float().flatten().tolist()

@pytest.fixture(scope="module")
def ray_session():
    import ray

    start_local_ray(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    return tiny_model_factory("qwen3")
