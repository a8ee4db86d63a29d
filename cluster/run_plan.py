"""What a run starts from, settled before any actor exists: run directory, resolved config, data
(fields checked), initial weights (warm start or a model directory) and the checkpoint to resume.
Every mistake a user can make here is a ``ConfigError`` naming the bad value.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from cluster.config import ConfigError, check_device, check_outlives_job, save_config
from cluster.run_checkpoints import Checkpoints, DamagedCheckpoint, DriverState
from cluster.data import Problem, data_sources, keep_fitting, load_split
from cluster.prompts import prompt_format
from cluster.train_config import TrainConfig


@dataclass
class RunPlan:
    """What a run starts from, checked before any actor exists."""

    run_dir: Path
    model_path: str
    train_problems: list[Problem]
    eval_problems: list[Problem]
    resume: tuple[Path, DriverState] | None


def prepare(cfg: TrainConfig) -> RunPlan:
    """Run directory, resolved config, data (fields checked) and initial weights; no Ray yet."""
    check_devices(cfg)
    check_outlives_job(cfg.run_dir, "run_dir")
    run_dir = Path(cfg.run_dir).expanduser().resolve()
    checkpoints = Checkpoints(run_dir, cfg.checkpoint.keep)
    resume = latest_checkpoint(checkpoints) if cfg.resume else None
    if cfg.resume and resume is None:
        raise ConfigError(f"resume=true but {run_dir / 'checkpoints'} holds no complete, intact checkpoint")
    if not cfg.resume and checkpoints.complete():
        raise ConfigError(f"run_dir {str(run_dir)!r} already holds checkpoints of a run; pass resume=true to "
                          "continue it, or choose another run_dir")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, run_dir / "config.yaml")
    except OSError as err:
        raise ConfigError(f"run_dir {str(run_dir)!r} cannot be written ({err.strerror or err}); choose a "
                          "writable folder") from None
    train_source, eval_source = data_sources(cfg, run_dir)
    train_problems = load_split(cfg, train_source)
    wants_eval = cfg.eval.before or cfg.eval.after
    eval_problems = load_split(cfg, eval_source, cfg.eval.num_problems) if wants_eval else []
    # prompts are written (raw or chat template) and checked against the configured model's tokenizer and
    # length first: a dataset nothing of which fits is an error before the warm start (which keeps the
    # tokenizer and the config)
    train_problems, eval_problems = engine_prompts(cfg, cfg.model.resolve(), train_problems, eval_problems)
    return RunPlan(run_dir, initial_model(cfg), train_problems, eval_problems, resume)


def latest_checkpoint(checkpoints: Checkpoints) -> tuple[Path, DriverState] | None:
    """``checkpoints.latest()`` (damaged ones skipped with a warning); one it cannot judge is a ConfigError."""
    try:
        return checkpoints.latest()
    except DamagedCheckpoint as err:
        raise ConfigError(f"resume=true: {err}") from None


def engine_prompts(cfg: TrainConfig, model_path: str, train: list[Problem], evaluation: list[Problem]):
    """Train and eval problems with their prompts written by ``cfg.data`` (raw or the chat template of
    ``model_path``'s tokenizer), kept when the written prompt fits the engine's max_model_len (others left
    out, counted)."""
    from transformers import AutoConfig

    from rollout.loader import load_tokenizer

    limit = cfg.engine.max_model_len or AutoConfig.from_pretrained(model_path, local_files_only=True).max_position_embeddings
    prompts = prompt_format(cfg.data, cfg.model, load_tokenizer(model_path))
    fitting = keep_fitting(prompts.apply(train), limit, "train")
    return fitting, keep_fitting(prompts.apply(evaluation), limit, "eval") if evaluation else evaluation


def initial_model(cfg: TrainConfig) -> str:
    """The configured model, warm-started by its SFT stage when enabled (trained now unless cached)."""
    model_path = cfg.model.resolve()
    if not cfg.warmstart.enabled:
        return model_path
    from cluster.sft_job import warm_start

    return warm_start(cfg, model_path)


def check_devices(cfg: TrainConfig) -> None:
    """A CUDA device asked of a local run whose torch has no CUDA is a ConfigError (before Ray starts).

    Joining a cluster, the driver's own torch says nothing about the workers' nodes: Ray's resource
    check covers them (``rollout.num_gpus``, ``learner.num_gpus``).
    """
    from cluster.resources import cluster_address

    if cluster_address(cfg) is not None:
        return
    for key, device in (("engine.device", cfg.engine.device), ("learner.device", cfg.learner.device),
                        ("warmstart.learner.device", cfg.warmstart.learner.device if cfg.warmstart.enabled else "cpu")):
        check_device(device, key)
