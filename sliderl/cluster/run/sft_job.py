"""SFT stages as jobs: ``sliderl sft`` and the warm start of ``sliderl train``.

Both turn an ``SFTStage`` (data, learner settings, steps) into ``trainer.sft`` examples — a generated
task's reference solutions (arith, regmachine, pasta), a user's file of prompt/completion pairs, or a file of chat
conversations — their prompts written by a ``cluster.config.prompts.PromptFormat`` exactly as the engine will
receive them, and train them with the one trainer, ``trainer.Learner`` with the SFT algorithm, under one KV policy
(the job's ``kv``; for the warm start, the rollouts' ``engine.kv``). The warm start runs on its own actor and its
checkpoint is cached by everything that shapes its weights (``cluster.actors.warm_start``); ``sliderl sft`` writes its
checkpoint to ``output_dir/model``.
"""

from __future__ import annotations

from pathlib import Path

from sliderl.cluster.config.prompts import PromptFormat
from sliderl.cluster.config.sft import SFTJobConfig, SFTStage
from sliderl.cluster.config.task import GENERATED_TASKS
from sliderl.cluster.errors import ConfigError
from sliderl.cluster.storage.data import open_dataset
from sliderl.trainer.sft import SFTExample, run_sft

Prompt = str | list[dict]  # a problem's text, or the chat messages before the completion


def stage_examples(stage: SFTStage, task, prompts: PromptFormat | None = None) -> tuple[list[SFTExample], list[SFTExample]]:
    """(train, held-out) examples of ``stage`` (``stage_pairs``), their prompts written by ``prompts`` (None: the
    prompts as they are, raw)."""
    train, held_out = stage_pairs(stage, task)
    return written(prompts, train, stage.data.source), written(prompts, held_out, stage.data.source)


def stage_pairs(stage: SFTStage, task) -> tuple[list[tuple[Prompt, str]], list[tuple[Prompt, str]]]:
    """(train, held-out) (prompt, completion) pairs of ``stage``, checked: from a generated ``task`` (its
    ``data.task_solution``) or from ``stage.data.source`` (prompt/completion columns, or chat messages whose
    last, the assistant's, is the completion). Needs no tokenizer, so bad data is found before a model loads.

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
        pairs = [(r["prompt"], r[d.task_solution]) for r in rows]
        return pairs[:n], pairs[n:]
    table = open_dataset(d.source, "train")
    if d.messages_field in table.column_names:
        pairs = [conversation_pair(m, row, d.source) for row, m in enumerate(table[d.messages_field])]
    else:
        missing = [f for f in (d.prompt_field, d.completion_field) if f not in table.column_names]
        if missing:
            raise ConfigError(f"SFT data {d.source!r} has no field {missing[0]!r}; its fields are "
                              f"{', '.join(table.column_names)}; set data.prompt_field / data.completion_field "
                              f"(or data.messages_field for chat conversations)")
        pairs = [(str(p), str(c)) for p, c in zip(table[d.prompt_field], table[d.completion_field])]
    if len(pairs) <= d.held_out:
        raise ConfigError(f"SFT data {d.source!r} has {len(pairs)} rows; data.held_out={d.held_out} leaves none "
                          "to train on")
    return pairs[:-d.held_out], pairs[-d.held_out:]


def conversation_pair(messages, row: int, source: str) -> tuple[list[dict], str]:
    """One chat conversation as (the messages before the last, the last one's content); the last must be the
    assistant's. Keys other than role and content (name, reasoning_content, ...) reach the template; a key
    that is null (a column other rows have) is left out."""
    where = f"SFT data {source!r} row {row}"
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages):
        raise ConfigError(f"{where}: messages must be a non-empty list of {{role, content}} with text content, "
                          f"got {str(messages)[:120]!r}")
    if messages[-1]["role"] != "assistant":
        raise ConfigError(f"{where}: the last message is the completion and must be the assistant's, got role "
                          f"{messages[-1]['role']!r}")
    return [{k: v for k, v in m.items() if v is not None} for m in messages[:-1]], messages[-1]["content"]


def written(prompts: PromptFormat | None, pairs: list[tuple[Prompt, str]], source: str) -> list[SFTExample]:
    """``pairs`` as SFTExamples, prompts written by ``prompts``: a raw prompt as text (the trainer tokenizes it as
    the engine does), a chat prompt (a problem's or a conversation's) with its template's token ids."""
    examples = []
    for prompt, completion in pairs:
        if prompts is not None and prompts.chat:
            text, ids = prompts.problem(prompt) if isinstance(prompt, str) else prompts.conversation(prompt)
            examples.append(SFTExample(text, completion, tuple(ids)))
        elif isinstance(prompt, str):
            examples.append(SFTExample(prompts.template.format(prompt=prompt) if prompts else prompt, completion))
        else:
            raise ConfigError(f"SFT data {source!r} holds chat conversations, which need the chat template, but "
                              "prompts here are raw (data.template is set, data.chat_template=false, or the train "
                              "job's rollouts resolve to raw prompts: set data.chat_template=true)")
    return examples


def run_sft_job(cfg: SFTJobConfig, train: list[SFTExample], held_out: list[SFTExample]):
    """``sliderl sft``: train ``cfg.model`` on ``train`` (from ``stage_examples``); the checkpoint lands in
    ``output_dir/model``."""
    return run_sft(cfg.model.resolve(), Path(cfg.output_dir) / "model", train, held_out, cfg.kv, cfg.learner, cfg.sft)
