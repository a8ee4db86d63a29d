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
    table = open_dataset(d.source, "train", d.max_line_bytes)
    chat = d.messages_field in table.column_names
    if not chat:
        missing = [f for f in (d.prompt_field, d.completion_field) if f not in table.column_names]
        if missing:
            raise ConfigError(f"SFT data {d.source!r} has no field {missing[0]!r}; its fields are "
                              f"{', '.join(table.column_names)}; set data.prompt_field / data.completion_field "
                              f"(or data.messages_field for chat conversations)")
    columns = [table[d.messages_field]] if chat else [table[d.prompt_field], table[d.completion_field]]
    pairs, left_out = [], []
    for row, values in enumerate(zip(*columns)):
        try:
            pairs.append(conversation_pair(values[0], row, d.source) if chat else text_pair(*values, row, d.source))
        except ConfigError as err:
            if not d.skip_invalid:
                raise ConfigError(f"{err}; fix the row, or set data.skip_invalid=true to leave such rows out") from None
            left_out.append(row)
    if left_out:
        print(f"sliderl: left out {len(left_out)} rows of SFT data {d.source!r} without a prompt or completion "
              f"(first: row {left_out[0]})", flush=True)
    if len(pairs) <= d.held_out:
        raise ConfigError(f"SFT data {d.source!r} has {len(pairs)} rows; data.held_out={d.held_out} leaves none "
                          "to train on")
    return pairs[:-d.held_out], pairs[-d.held_out:]


def text_pair(prompt, completion, row: int, source: str) -> tuple[str, str]:
    """One row of prompt/completion columns; ConfigError naming the row when either is missing, null or blank (a
    null completion would otherwise be trained as the text "None")."""
    for name, value in (("prompt", prompt), ("completion", completion)):
        if value is None or (isinstance(value, str) and not value.strip()):
            raise ConfigError(f"SFT data {source!r} row {row} has no {name} (got {value!r})")
        if not isinstance(value, str):
            raise ConfigError(f"SFT data {source!r} row {row}: the {name} must be text, got {type(value).__name__} "
                              f"{str(value)[:60]!r}")
    return prompt, completion


def keep_fitting_examples(parts: tuple[list[SFTExample], list[SFTExample]], tokenizer, context: int,
                          skip_invalid: bool, source: str) -> tuple[list[SFTExample], list[SFTExample]]:
    """(train, held-out) without the examples whose prompt + completion + eos (tokenized as ``trainer.sft``
    does) is longer than ``context`` tokens: a ConfigError naming the first one, or with ``skip_invalid`` left
    out and counted. Examples are numbered in file order (train, then held-out)."""
    examples = [e for part in parts for e in part]
    kept: tuple[list[SFTExample], list[SFTExample]] = ([], [])
    too_long: list[tuple[int, int]] = []
    for index, example in enumerate(examples):
        length = _token_bound(example)
        if length > context:  # only an example that may not fit is tokenized
            prompt = example.prompt_token_ids or tokenizer(example.prompt).input_ids
            length = len(prompt) + len(tokenizer(example.completion, add_special_tokens=False).input_ids) + 1
        if length <= context:
            kept[index >= len(parts[0])].append(example)
        elif not skip_invalid:
            raise ConfigError(f"SFT data {source!r} row {index}: prompt + completion is {length} tokens, longer "
                              f"than the model's context of {context}; shorten it, or set data.skip_invalid=true "
                              "to leave such rows out")
        else:
            too_long.append((index, length))
    if too_long:
        print(f"sliderl: left out {len(too_long)} SFT examples of {source!r} longer than the context of {context} "
              f"tokens (first: row {too_long[0][0]}, {too_long[0][1]} tokens)", flush=True)
    if not kept[0]:
        raise ConfigError(f"no SFT example of {source!r} to train on fits the model's context of {context} tokens")
    return kept


def _token_bound(example: SFTExample, specials: int = 16) -> int:
    """At least the example's tokens: a token covers at least one byte of text (byte-level BPE, SentencePiece with
    byte fallback), plus ``specials`` for the BOS and markers a tokenizer adds and the eos."""
    prompt = len(example.prompt_token_ids) if example.prompt_token_ids is not None else len(example.prompt.encode())
    return prompt + len(example.completion.encode()) + specials


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
