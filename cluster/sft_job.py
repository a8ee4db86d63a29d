"""SFT stages as jobs: ``sliderl sft`` and the warm start of ``sliderl train``.

Both turn an ``SFTStage`` (data, learner settings, steps) into ``trainer.sft`` examples — a generated
task's reference solutions (arith, regmachine) or a user's file of prompt/completion pairs — and train them with the
one trainer, ``trainer.Learner`` with the SFT algorithm, under one KV policy (the job's ``kv``; for
the warm start, the rollouts' ``engine.kv``). The warm start runs on its own actor and its checkpoint
is cached by everything that shapes its weights (``cluster.warm_start``); ``sliderl sft`` writes its
checkpoint to ``output_dir/model``.
"""

from __future__ import annotations

from pathlib import Path

from cluster.config import ConfigError
from cluster.data import open_dataset
from cluster.sft_config import SFTJobConfig, SFTStage
from cluster.task_config import GENERATED_TASKS
from trainer.sft import SFTExample, run_sft


def stage_examples(stage: SFTStage, task) -> tuple[list[SFTExample], list[SFTExample]]:
    """(train, held-out) examples of ``stage``: from a generated ``task`` (its ``data.task_solution``) or from ``stage.data.source``.

    Task: step s trains on problems ``s*B .. (s+1)*B - 1`` of the train split (each seen once), and the
    ``held_out`` problems after them are scored. File: the last ``held_out`` rows are held out.
    """
    d = stage.data
    if d.source == "task":
        if task.type not in GENERATED_TASKS:
            raise ConfigError(f"an SFT stage with data.source=task needs a generated task ({', '.join(GENERATED_TASKS)}), "
                              f"got task.type={task.type}")
        n = stage.sft.steps * stage.sft.batch_size
        rows = task.generator().problems(n + d.held_out, "train")
        if d.task_solution not in rows[0]:
            raise ConfigError(f"data.task_solution={d.task_solution!r}: task.type={task.type} writes the solutions "
                              f"{', '.join(k for k in rows[0] if k.startswith('solution'))}")
        examples = [SFTExample(r["prompt"], r[d.task_solution]) for r in rows]
        return examples[:n], examples[n:]
    table = open_dataset(d.source, "train")
    missing = [f for f in (d.prompt_field, d.completion_field) if f not in table.column_names]
    if missing:
        raise ConfigError(f"SFT data {d.source!r} has no field {missing[0]!r}; its fields are "
                          f"{', '.join(table.column_names)}; set data.prompt_field / data.completion_field")
    examples = [SFTExample(str(p), str(c)) for p, c in zip(table[d.prompt_field], table[d.completion_field])]
    if len(examples) <= d.held_out:
        raise ConfigError(f"SFT data {d.source!r} has {len(examples)} rows; data.held_out={d.held_out} leaves none "
                          "to train on")
    return examples[:-d.held_out], examples[-d.held_out:]


def run_sft_job(cfg: SFTJobConfig, train: list[SFTExample], held_out: list[SFTExample]):
    """``sliderl sft``: train ``cfg.model`` on ``train`` (from ``stage_examples``); the checkpoint lands in
    ``output_dir/model``."""
    return run_sft(cfg.model.resolve(), Path(cfg.output_dir) / "model", train, held_out, cfg.kv, cfg.learner, cfg.sft)
