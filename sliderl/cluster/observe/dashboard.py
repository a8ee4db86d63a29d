"""What the Ray dashboard shows of a run: its label, the names of its actors, and its job's metadata.

A run's *label* is its run name (the last part of ``run_dir``) and six hex digits of a hash of the
whole storage root, e.g. ``smoke-3f9a1c``: every driver of the run computes the same one, so a
resumed run, a worker Ray restarts and a learner rebuilt from its checkpoint keep their names, and
two runs whose folders share a last part still differ. Actors are named ``<label>/<role>``:
``learner``, ``rollout-<i>``, ``trace-queue`` and ``warm-start``; the dashboard's Actors page lists
them by these names, and ``ray.get_actor(name)`` finds them from the run's driver. Ray keeps a name
within its job's namespace, and a session's actors are killed (which frees their names at once)
before the next session of the same driver names its own.

The job's *metadata* is what the Jobs page shows of the run: ``job_name`` (the label; the page's
Name column) and ``sliderl_*`` keys (run_dir, config, kv_policy, model, algo, version, commit).
``sliderl train`` hands it to ``ray.init``, so a driver that starts or joins Ray carries it; a job
started with ``ray job submit`` shows the metadata given at submission instead, which
``sliderl job-metadata CONFIG [key=value ...]`` prints (``--metadata-json "$(sliderl job-metadata ...)"``).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sliderl.cluster.config.train import TrainConfig

REPO = Path(__file__).resolve().parents[3]
LABEL_KEY = "job_name"  # the metadata key the Jobs page shows as the job's Name
RUN_KEY = "sliderl_run"
QUEUE, LEARNER, WARM_START = "trace-queue", "learner", "warm-start"
BASELINE = "baseline-lengths"  # the Ray task of Pasta's Baseline-SFT lengths (cluster.actors.baseline)


# ------------------------------------------------------------------------------------ names


def root_location(run_dir: str) -> str:
    """The storage root as one string, without opening it: a local path made absolute, or the URI without
    its query (options such as an endpoint) and trailing slash."""
    if "://" in run_dir and not run_dir.startswith("file://"):
        return run_dir.split("?", 1)[0].rstrip("/")
    return str(Path(run_dir.removeprefix("file://")).expanduser().resolve())


def run_name(run_dir: str) -> str:
    """The last part of the storage root: ``runs/smoke`` -> ``smoke``, ``s3://b/exp/run1?x=y`` -> ``run1``."""
    return root_location(run_dir).rsplit("/", 1)[-1]


def run_label(run_dir: str) -> str:
    """``<run name>-<6 hex digits of the root's hash>``: the same for every driver of one run."""
    location = root_location(run_dir)
    return f"{run_name(run_dir)}-{hashlib.sha256(location.encode()).hexdigest()[:6]}"


def actor_name(cfg: TrainConfig, role: str) -> str:
    """The Ray name of the run's actor ``role`` (``learner``, ``rollout-0``, ``trace-queue``, ``warm-start``;
    ``baseline-lengths`` names a task)."""
    return f"{run_label(cfg.run_dir)}/{role}"


def rollout_role(worker_id: int) -> str:
    return f"rollout-{worker_id}"


# --------------------------------------------------------------------------------- metadata


def job_metadata(cfg: TrainConfig, config_path: str | None) -> dict[str, str]:
    """The Ray job's metadata for run ``cfg`` (strings only, as Ray requires); ``config_path``: the file given
    to ``sliderl train`` (None: the default recipe)."""
    model = cfg.model
    return {
        LABEL_KEY: run_label(cfg.run_dir),
        RUN_KEY: run_name(cfg.run_dir),
        "sliderl_run_dir": root_location(cfg.run_dir),
        "sliderl_config": config_path or f"configs/{cfg.RECIPE}",
        "sliderl_kv_policy": cfg.engine.kv,
        "sliderl_model": model.path if model.type == "hf" else f"tiny {model.arch} ({model.name}, random weights)",
        "sliderl_algo": cfg.learner.algo.type,
        "sliderl_version": sliderl_version(),
        "sliderl_commit": sliderl_commit(),
    }


def sliderl_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sliderl")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


def sliderl_commit() -> str:
    """``git describe --always --dirty`` of the source tree this code runs from; ``unknown`` outside a git
    checkout (e.g. the copy of the working dir a submitted job runs in)."""
    try:
        described = subprocess.run(["git", "-C", str(REPO), "describe", "--always", "--dirty", "--abbrev=12"],
                                   capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return described.stdout.strip() if described.returncode == 0 and described.stdout.strip() else "unknown"


def job_config(metadata: dict[str, str]):
    """``ray.job_config.JobConfig`` carrying ``metadata`` (a driver's ``ray.init`` shows it on the Jobs page)."""
    from ray.job_config import JobConfig

    return JobConfig(metadata=dict(metadata))


def warn_if_submitted_without_metadata() -> None:
    """In a job started by ``ray job submit`` (whose metadata the Jobs page shows), a one-line hint on stderr
    when the submission carries no sliderl metadata."""
    job = os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR")  # set by Ray in a submitted job's entrypoint
    if job is None:
        return
    try:
        submitted = json.loads(job).get("metadata") or {}
    except (ValueError, AttributeError):
        return
    if RUN_KEY not in submitted:
        print("sliderl: this job was submitted without sliderl's metadata, so the dashboard's Jobs page shows no "
              "run name, config or KV policy for it; submit with --metadata-json \"$(sliderl job-metadata CONFIG "
              "key=value ...)\" (the same CONFIG and overrides as the job)", file=sys.stderr, flush=True)
