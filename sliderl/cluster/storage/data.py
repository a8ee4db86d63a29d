"""Prompt data: datasets read with ``datasets``, checked, and dealt out as groups with stable ids.

A ``Problem`` is one row (id, prompt, reference answer); ``load_problems`` gives the problem text as
its prompt and ``cluster.config.prompts.PromptFormat.apply`` the formatted prompt with its token ids, which
the engine receives as they are. ``PromptStream`` deals problems in a seeded order, a fresh
permutation per pass, as ``PromptGroup`` records; the n-th group dealt has
id ``g{n:08d}`` whatever happens later, so a group re-issued after a worker died keeps its id and
the trace log can be checked against the learner's list of trained groups. The stream's whole
state is its cursor (groups dealt so far), which checkpoints store.
"""

from __future__ import annotations

import random
from pathlib import Path

from sliderl.cluster.errors import ConfigError
from sliderl.cluster.records import Problem, PromptGroup
from sliderl.cluster.storage.data_files import DEFAULT_MAX_LINE_BYTES, check_data_files

FILE_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def load_problems(source: str, split: str, prompt_field: str, answer_field: str,
                  id_field: str | None = None, limit: int | None = None, skip_invalid: bool = False,
                  max_line_bytes: int = DEFAULT_MAX_LINE_BYTES) -> list[Problem]:
    """Rows of ``source`` (a local file/folder or a hub name) as Problems whose prompt is the problem text,
    fields checked first.

    Raises ConfigError naming the source when it cannot be read or lacks ``prompt_field`` or
    ``answer_field`` (listing the fields it has), and naming the row and field of the first row whose
    prompt or answer is missing (null or empty) — unless ``skip_invalid``, which drops such rows and
    prints how many. A local file is checked first (``check_data_files``, lines up to ``max_line_bytes``).
    """
    table = open_dataset(source, split, max_line_bytes)
    columns = list(table.column_names)
    missing = [f for f in (prompt_field, answer_field) if f not in columns]
    if missing:
        raise ConfigError(f"dataset {source!r} (split {split!r}) has no field {missing[0]!r}; its fields are "
                          f"{', '.join(columns)}; set data.prompt_field / data.answer_field to the right columns")
    rows = table.select(range(min(limit, len(table)))) if limit is not None else table
    ids = rows[id_field] if id_field and id_field in columns else [f"row-{i:08d}" for i in range(len(rows))]
    prompts, answers = rows[prompt_field], rows[answer_field]
    if not prompts:
        raise ConfigError(f"dataset {source!r} (split {split!r}) is empty")
    problems, bad = [], []
    for row, (i, p, a) in enumerate(zip(ids, prompts, answers)):
        field = prompt_field if _blank(p) else answer_field if _blank(a) else None
        if field is None:
            problems.append(Problem(str(i), str(p), str(a)))
        elif not skip_invalid:
            got = p if field == prompt_field else a
            raise ConfigError(f"dataset {source!r} (split {split!r}) row {row} has no {field!r} (got {got!r}); "
                              "fix the row, or set data.skip_invalid=true to leave such rows out")
        else:
            bad.append((row, field))
    if bad:
        print(f"sliderl: left out {len(bad)} rows of {source!r} (split {split!r}) without a prompt or answer "
              f"(first: row {bad[0][0]}, field {bad[0][1]!r})", flush=True)
    if not problems:
        raise ConfigError(f"dataset {source!r} (split {split!r}) has no row with both a prompt and an answer")
    return problems


def _blank(value) -> bool:
    return value is None or (isinstance(value, str) and not value.strip())


def keep_fitting(problems: list[Problem], max_model_len: int, what: str) -> list[Problem]:
    """The problems whose formatted prompt (its token ids, ``PromptFormat.apply``) leaves room for a generated
    token within ``max_model_len``; prints how many were left out, and raises ConfigError when none is left."""
    fitting = [p for p in problems if len(p.prompt_token_ids) < max_model_len]
    if len(fitting) < len(problems):
        print(f"sliderl: left out {len(problems) - len(fitting)} of {len(problems)} {what} problems whose prompt "
              f"does not fit max_model_len={max_model_len}", flush=True)
    if not fitting:
        raise ConfigError(f"no {what} prompt fits max_model_len={max_model_len} (engine.max_model_len, or the "
                          "model's max_position_embeddings); raise it or shorten the prompts")
    return fitting


def is_local(source: str) -> bool:
    """True when ``source`` names a local file or folder rather than a hub dataset: it exists, starts with
    ``.``, ``/`` or ``~``, or ends in a data-file suffix (.jsonl, .json, .parquet)."""
    return source.startswith((".", "/", "~")) or Path(source).suffix in FILE_FORMATS or Path(source).expanduser().exists()


def check_source(source: str | None) -> str | None:
    """``source`` unchanged (a config validator); ValueError when it names a local file or folder that does not exist."""
    if source is not None and is_local(source) and not Path(source).expanduser().exists():
        raise ValueError(_missing(source))
    return source


def _missing(source: str) -> str:
    return (f"dataset {source!r} does not exist (expected a local .jsonl/.json/.parquet file or a folder of them, "
            "or a hub dataset name)")


def open_dataset(source: str, split: str, max_line_bytes: int = DEFAULT_MAX_LINE_BYTES):
    """``source`` (a data file, a folder of them, or a hub name) as a ``datasets.Dataset``; ConfigError when
    it cannot be read. Local files are checked first (``check_data_files``): a bad one is named with its line."""
    import datasets

    datasets.disable_progress_bars()
    path = Path(source).expanduser()
    try:
        if path.is_file():
            kind = FILE_FORMATS.get(path.suffix)
            if kind is None:
                raise ConfigError(f"dataset file {source!r} has an unknown suffix; valid: {', '.join(FILE_FORMATS)}")
            check_data_files(source, max_line_bytes)
            return datasets.load_dataset(kind, data_files=str(path), split=split)
        if is_local(source):
            if not path.exists():
                raise ConfigError(_missing(source))
            check_data_files(source, max_line_bytes)
            return datasets.load_dataset(str(path), split=split)
        return datasets.load_dataset(source, split=split)
    except ConfigError:
        raise
    except (ValueError, OSError) as err:
        hint = " (hub datasets need the network: HF_HUB_OFFLINE=0)" if not path.exists() else ""
        raise ConfigError(f"cannot load dataset {source!r} split {split!r}{hint}: {' '.join(str(err).split())}") from None


class PromptStream:
    """Deals PromptGroups from ``problems`` in a seeded order; a new permutation every pass.

    ``deal(k)`` returns the next k groups; ``cursor`` (groups dealt so far) is the whole state:
    ``PromptStream(problems, ..., cursor=c)`` continues exactly where a stream at c was.
    """

    def __init__(self, problems: list[Problem], group_size: int, seed: int, shuffle: bool = True, cursor: int = 0):
        if not problems:
            raise ValueError("PromptStream needs at least one problem")
        self.problems = problems
        self.group_size = group_size
        self.seed = seed
        self.shuffle = shuffle
        self.cursor = cursor
        self._pass, self._order = -1, list(range(len(problems)))

    def deal(self, k: int) -> list[PromptGroup]:
        """The next ``k`` groups."""
        groups = [self.group(self.cursor + i) for i in range(k)]
        self.cursor += k
        return groups

    def group(self, n: int) -> PromptGroup:
        """The ``n``-th group of the stream (the same whenever it is asked for)."""
        pass_index, offset = divmod(n, len(self.problems))
        problem = self.problems[self._permutation(pass_index)[offset]]
        seed = (self.seed * 1_000_003 + n * self.group_size) % (2**31)
        return PromptGroup(f"g{n:08d}", problem, self.group_size, seed)

    def _permutation(self, pass_index: int) -> list[int]:
        if pass_index != self._pass:
            self._pass, self._order = pass_index, list(range(len(self.problems)))
            if self.shuffle:
                random.Random(f"prompts:{self.seed}:{pass_index}").shuffle(self._order)
        return self._order


def data_sources(cfg, run_dir: str | Path) -> tuple[tuple[str, str], tuple[str, str]]:
    """``((train source, split), (eval source, split))`` of a TrainConfig.

    ``data.source: task`` writes the task's problems to ``run_dir/data/{train,eval}.jsonl`` first
    (a single file is split ``train`` for ``datasets``).
    """
    if cfg.data.source == "task":
        task = cfg.task.generator()
        folder = Path(run_dir) / "data"
        train = task.write_jsonl(folder / "train.jsonl", cfg.task.train_size, "train")
        held_out = task.write_jsonl(folder / "eval.jsonl", cfg.task.eval_size, "eval")
        return (str(train), "train"), (str(held_out), "train")
    return (cfg.data.source, cfg.data.split), (cfg.data.eval_source or cfg.data.source, cfg.data.eval_split)


def load_split(cfg, source: tuple[str, str], limit: int | None = None) -> list[Problem]:
    """``load_problems`` with the field names of ``cfg.data`` (prompts are the problem texts, not formatted yet)."""
    d = cfg.data
    return load_problems(source[0], source[1], d.prompt_field, d.answer_field, d.id_field, limit, d.skip_invalid,
                         d.max_line_bytes)
