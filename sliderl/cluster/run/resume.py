"""Resuming a run: the new config checked against the run's own, the history of the configs a run ran with,
and the run's records rolled back to the checkpoint it resumes from.

A resume may change how a run goes on — its length, evaluation, logging, workers, resources — but not what the
run is: ``MEANING`` lists the settings whose change would mix two runs in one (another model or task, other
prompts or another prompt order, another KV policy, group size, algorithm or vocabulary); such a change is a
ConfigError listing every differing key with both values. Allowed changes are printed. ``config.yaml`` is always
the config the run runs with now; ``config_history.yaml`` keeps every session's, one YAML document each.

Rolling back: the trace log keeps only the groups the checkpoint resolved (the others are generated and logged
again) and ``metrics.jsonl`` only the rows of steps up to the checkpoint's (the later ones are taken again), so
each group and each step is recorded once.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path, PurePath
from typing import TYPE_CHECKING, Any

import yaml

from sliderl.cluster.errors import ConfigError
from sliderl.cluster.storage.root import Storage

if TYPE_CHECKING:
    from sliderl.cluster.run.checkpoints import DriverState
    from sliderl.cluster.storage.trace_log import TraceLog

CONFIG_FILE = "config.yaml"
HISTORY_FILE = "config_history.yaml"
# settings that decide what a run is; a key equal to one of them or under it counts (model.cache_dir is where a
# tiny model is built, not which)
MEANING = ("model", "task", "data.source", "data.split", "data.prompt_field", "data.answer_field", "data.id_field",
           "data.shuffle", "data.template", "data.chat_template", "data.system_prompt", "data.instruction",
           "data.enable_thinking", "engine.kv", "rollout.group_size", "learner.algo", "learner.vocab_policy",
           "train.seed")
HARMLESS_UNDER_MEANING = ("model.cache_dir",)
NOT_COMPARED = ("run_dir", "resume", "eval.compare")  # where the run is, and what the train job does not use


def config_changes(saved: dict, new: dict) -> dict[str, tuple[Any, Any]]:
    """``{dotted key: (saved value, new value)}`` of every leaf both configs have and that differs."""
    old, now = _leaves(saved), _leaves(new)
    return {key: (old[key], now[key]) for key in old.keys() & now.keys()
            if old[key] != now[key] and not _under(key, NOT_COMPARED)}


def changes_meaning(key: str) -> bool:
    """Whether changing ``key`` would make another run of this one."""
    return _under(key, MEANING) and not _under(key, HARMLESS_UNDER_MEANING)


def _under(key: str, prefixes: tuple[str, ...]) -> bool:
    return any(key == p or key.startswith(p + ".") for p in prefixes)


def check_resumed_config(storage: Storage, new: dict) -> list[str]:
    """Compare ``new`` (a config as ``model_dump(mode="json")`` gives it) with the run's ``config.yaml``: a
    ConfigError naming every key that changes the run's meaning, else the allowed changes as ``key: a -> b``
    lines (none when the run has no readable config.yaml, e.g. one written before it was kept)."""
    path = storage.path(CONFIG_FILE)
    if not storage.is_file(path):
        return []
    try:
        saved = yaml.safe_load(storage.read_bytes(path).decode("utf-8"))
    except (OSError, ValueError, yaml.YAMLError) as err:
        raise ConfigError(f"resume=true: the run's {storage.uri(path)} does not read ({' '.join(str(err).split())}); "
                          "it is compared with the new config: restore it, or start a new run_dir") from None
    changes = config_changes(saved if isinstance(saved, dict) else {}, new)
    refused = sorted(key for key in changes if changes_meaning(key))
    if refused:
        shown = "; ".join(f"{key}: {_show(changes[key][0])} -> {_show(changes[key][1])}" for key in refused)
        raise ConfigError(f"resume=true with settings that change what the run is ({shown}): a resumed run keeps its "
                          f"model, task, prompts, KV policy, group size, algorithm and vocabulary; keep them as in "
                          f"{storage.uri(path)}, or start a new run_dir")
    return [f"{key}: {_show(a)} -> {_show(b)}" for key, (a, b) in sorted(changes.items())]


def record_config(storage: Storage, config_yaml: str, note: str) -> None:
    """Write ``config.yaml`` (the config the run runs with now) and add it to ``config_history.yaml`` as one
    more YAML document, headed by ``note`` and the time."""
    history = storage.path(HISTORY_FILE)
    before = storage.read_bytes(history).decode("utf-8") if storage.is_file(history) else ""
    entry = f"# {time.strftime('%Y-%m-%d %H:%M:%S')}: {note}\n{config_yaml}"
    storage.write_bytes(history, (before + ("---\n" if before else "") + entry).encode())
    storage.write_bytes(storage.path(CONFIG_FILE), config_yaml.encode())


def roll_back(checkpoint: tuple[PurePath, DriverState], trace_log: TraceLog, metrics: Path) -> None:
    """Roll the run's trace log and ``metrics`` back to ``checkpoint`` (its folder and driver state), saying
    what went."""
    path, state = checkpoint
    ledger = state.ledger
    traces = trace_log.keep_groups(set(ledger.trained) | set(ledger.stale))
    rows = roll_back_metrics(metrics, state.step)
    if traces or rows:
        print(f"sliderl: rolled the run back to {path.name}: {traces} traces of groups it had not resolved will be "
              f"generated again, {rows} rows of metrics.jsonl of later steps taken again", flush=True)


def roll_back_metrics(path: Path, step: int) -> int:
    """Drop the rows of ``metrics.jsonl`` at ``path`` for steps after ``step`` (they are taken again); the
    number dropped. The file is replaced whole (a temp file renamed over it); a line cut short by a crash goes."""
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row_step = int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            dropped += bool(line.strip())
            continue
        if row_step <= step:
            kept.append(line)
        else:
            dropped += 1
    if dropped:
        temp = path.with_name(f".{path.name}.rollback-{os.getpid()}")
        temp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
        os.replace(temp, path)
    return dropped


def _leaves(data: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a.b": leaf}`` of a nested mapping (a list is one leaf)."""
    if not isinstance(data, dict):
        return {prefix: data}
    out: dict[str, Any] = {}
    for key, value in data.items():
        out.update(_leaves(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def _show(value: Any) -> str:
    return json.dumps(value)[:80]
