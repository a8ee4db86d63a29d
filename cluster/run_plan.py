"""What a run starts from, settled before any actor exists: run directory, resolved config, data
(fields checked), initial weights (warm start or a model directory) and the checkpoint to resume.
Every mistake a user can make here is a ``ConfigError`` naming the bad value.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from cluster.checkpoint import Checkpoints, DriverState
from cluster.config import ConfigError, save_config
from cluster.data import Problem, data_sources, load_split
from cluster.train_config import TrainConfig
from rewards.arith import format_prompt

if TYPE_CHECKING:
    from trainer.learner_args import LearnerArgs
    from trainer.sft import SFTArgs


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
    import tempfile

    from rollout.tiny import make_tiny_model  # torch and transformers load only when a warm start runs
    from trainer.sft import SFTExample, cached_sft

    ws = cfg.warmstart
    task = cfg.task.arith()
    problems = task.problems(ws.steps * ws.batch_size + WARMSTART_HELD_OUT, "train")
    examples = [SFTExample(p["prompt"], p["solution"]) for p in problems]
    print(f"sliderl: warm start ({ws.steps} SFT steps, cached in {ws.cache_dir})", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(Path(tmp) / "init", ws.arch, hidden_size=ws.hidden_size, num_layers=ws.num_layers,
                                num_heads=ws.num_heads, num_kv_heads=ws.num_kv_heads,
                                intermediate_size=ws.intermediate_size, seed=ws.seed,
                                max_position_embeddings=max(512, 2 * max_sequence_tokens(task)))
        result = cached_sft(ws.cache_dir, model, examples[:-WARMSTART_HELD_OUT], examples[-WARMSTART_HELD_OUT:],
                            ws.train_kv, warmstart_learner_args(cfg), warmstart_sft_args(cfg))
    return result.path


WARMSTART_HELD_OUT = 64  # held-out train problems (never trained on) scored at each warm-start check


def warmstart_learner_args(cfg: TrainConfig) -> LearnerArgs:
    """The warm start's optimizer: AdamW (0.9, 0.98), linear warm-up then cosine to 0.1, loss on every token."""
    from trainer.algorithms import SFTOptions
    from trainer.learner_args import LearnerArgs

    ws = cfg.warmstart
    return LearnerArgs(algo=SFTOptions(), lr=ws.lr, weight_decay=ws.weight_decay, adam_betas=(0.9, 0.98),
                       lr_schedule="cosine", warmup_steps=ws.warmup_steps, total_steps=ws.steps,
                       window_mode="full", device=cfg.learner.device)


def warmstart_sft_args(cfg: TrainConfig) -> SFTArgs:
    from trainer.sft import SFTArgs

    ws = cfg.warmstart
    return SFTArgs(steps=ws.steps, batch_size=ws.batch_size, check_every=25, target_accuracy=ws.target_accuracy,
                   log_every=50)


def max_sequence_tokens(task) -> int:
    """An upper bound on prompt + completion tokens of any arith problem (byte-level: one token per char)."""
    prompt = format_prompt(task.max_value, [("+", task.max_operand)] * task.num_steps[1])
    return len(prompt) + task.max_completion_chars() + 1
