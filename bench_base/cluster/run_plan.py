"""What a run starts from, settled before any actor exists: run directory, resolved config, data
(fields checked), initial weights (warm start or a model directory) and the checkpoint to resume.
Every mistake a user can make here is a ``ConfigError`` naming the bad value.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from cluster.checkpoint import Checkpoints, DriverState
from cluster.config import ConfigError, save_config
from cluster.data import Problem, data_sources, load_split
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
    run_dir = Path(cfg.run_dir).expanduser().resolve()
    checkpoints = Checkpoints(run_dir, cfg.checkpoint.keep)
    resume = checkpoints.latest() if cfg.resume else None
    if cfg.resume and resume is None:
        raise ConfigError(f"resume=true but {run_dir / 'checkpoints'} holds no complete checkpoint")
    if not cfg.resume and checkpoints.complete():
        raise ConfigError(f"run_dir {str(run_dir)!r} already holds checkpoints of a run; pass resume=true to "
                          "continue it, or choose another run_dir")
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(cfg, run_dir / "config.yaml")
    train_source, eval_source = data_sources(cfg, run_dir)
    train_problems = load_split(cfg, train_source)
    wants_eval = cfg.eval.before or cfg.eval.after
    eval_problems = load_split(cfg, eval_source, cfg.eval.num_problems) if wants_eval else []
    return RunPlan(run_dir, initial_model(cfg), train_problems, eval_problems, resume)


def initial_model(cfg: TrainConfig) -> str:
    """The warm-started checkpoint (trained now when not cached) or the configured model."""
    if not cfg.warmstart.enabled:
        return cfg.model.resolve()
    from trainer.warmstart import warm_start

    print(f"sliderl: warm start ({cfg.warmstart.steps} SFT steps, cached in {cfg.warmstart.cache_dir})", flush=True)
    return str(warm_start(cfg.warmstart.cache_dir, cfg.task.arith(), device=cfg.learner.device,
                          log_every=50, **cfg.warmstart.settings()))
