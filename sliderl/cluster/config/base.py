"""Config loading: YAML plus ``key.sub=value`` overrides, validated into the job's typed records.

A job's config is one pydantic model (``GenerateConfig`` here; ``TrainConfig``, ``SFTJobConfig``
in ``cluster.config.train``) that *composes* the records of the parts it drives — ``EngineArgs``
beside ``rollout.LLM``, ``SamplingParams``, ``LearnerArgs`` beside ``trainer.Learner``, the reward
terms of ``rewards.spec`` — each declared once, with one library default and one docstring per
field. A recipe's own values live in its ``configs/*.yaml``; a job run without a file runs its
default recipe, and ``--help`` prints the values that recipe resolves to.

Before pydantic validates, ``check_keys`` walks the data against the schema so that an unknown key
(``reward.acc``, ``learner.algo.clip_lo``) or an unknown variant (``model.type=gguf``) is named
with the valid keys, whatever mix of pydantic models and dataclass records holds it. Errors are
``ConfigError``: one line, the key path, what was wrong and what would be valid.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import json
import os
import shutil
import textwrap
import time
import types
import typing
from functools import cache
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError, model_validator

from sliderl.cluster.errors import ConfigError
from sliderl.core.tiny import TinyModelSpec
from sliderl.rollout.engine_args import EngineArgs
from sliderl.rollout.sampling import SamplingParams

DEFAULT_MODEL_CACHE = "~/.cache/sliderl/models"
RECIPES = Path(__file__).resolve().parents[3] / "configs"

Schema = TypeVar("Schema", bound=BaseModel)


class Section(BaseModel):
    """Base of every config model: unknown keys are errors that list the valid keys."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_default=True)

    @model_validator(mode="before")
    @classmethod
    def _known_keys(cls, data: Any) -> Any:
        """Built directly (not through ``load_config``), an unknown key still names the valid ones."""
        if isinstance(data, dict):
            for key in data:
                if key not in cls.model_fields:
                    raise ValueError(unknown_key_message(key, list(cls.model_fields)))
        return data


def unknown_key_message(key: Any, valid: list[str]) -> str:
    """``unknown key 'x' (did you mean 'y'?); valid keys: a, b, c``."""
    close = difflib.get_close_matches(str(key), valid, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"unknown key {key!r}{hint}; valid keys: {', '.join(valid)}"


def base_record(section, base: type):
    """The ``base`` record a config section extends (``TinyModel`` -> ``TinyModelSpec``): its fields only."""
    return base(**{f.name: getattr(section, f.name) for f in dataclasses.fields(base)})


# --------------------------------------------------------------------------------------- model


@dataclasses.dataclass(frozen=True)
class TinyModel(TinyModelSpec):
    """A small random-weight model the project builds locally (no downloads), cached by its spec."""

    type: Literal["tiny"] = "tiny"
    """Variant tag: a locally built random-weight model."""
    cache_dir: str = DEFAULT_MODEL_CACHE
    """Folder that holds built tiny models; one subfolder per spec, built when missing."""

    def spec(self) -> TinyModelSpec:
        return base_record(self, TinyModelSpec)

    def resolve(self) -> str:
        """Path of the model directory, building it (atomically) when it is not there yet."""
        path = Path(self.cache_dir).expanduser() / self.name
        if not (path / "config.json").is_file():
            self._build(path)
        return str(path)

    def _build(self, path: Path) -> None:
        from sliderl.core.tiny import make_tiny_model

        path.parent.mkdir(parents=True, exist_ok=True)
        staging = path.parent / f".{path.name}.building-{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        make_tiny_model(staging, spec=self.spec())
        try:
            staging.rename(path)
        except OSError:  # another process finished the same model first
            if not (path / "config.json").is_file():
                raise
            shutil.rmtree(staging, ignore_errors=True)


class HFModel(Section):
    """A Hugging Face model directory on local disk (config.json, safetensors, tokenizer)."""

    type: Literal["hf"] = "hf"
    """Variant tag: a local Hugging Face directory."""
    path: str
    """Path of the directory; ``~`` is expanded."""

    def resolve(self) -> str:
        """The expanded path, checked to hold a config.json."""
        path = Path(self.path).expanduser()
        if not (path / "config.json").is_file():
            raise ConfigError(f"model.path {self.path!r} is not a Hugging Face model directory (no config.json there)")
        return str(path)


def _model_type(value: Any) -> str:
    if isinstance(value, dict):
        return value.get("type", "tiny")
    return getattr(value, "type", "tiny")


ModelSource = Annotated[
    Annotated[TinyModel, Tag("tiny")] | Annotated[HFModel, Tag("hf")],
    Discriminator(_model_type, custom_error_type="model_variant",
                  custom_error_message="model.type must be 'tiny' or 'hf'"),
]
"""Where the weights come from: ``type: tiny`` (default) or ``type: hf``; both have ``resolve() -> str``."""


# ----------------------------------------------------------------------------------- generate


def run_folder(kind: str):
    """A default factory for a job's output folder: ``runs/<kind>-<timestamp>``."""
    return lambda: f"runs/{kind}-{time.strftime('%Y%m%d-%H%M%S')}"


def check_outlives_job(folder: str, key: str) -> None:
    """Refuse a relative output folder in a job started by ``ray job submit --working-dir``.

    Such a job runs in Ray's temporary copy of the working dir, deleted with the job: a relative
    ``folder`` (the default ``runs/...`` too) would take the job's outputs with it.
    """
    job = os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR")  # set by Ray in a submitted job's entrypoint
    if job is None or Path(folder).expanduser().is_absolute() or "://" in folder:  # a URI is no folder of the job
        return
    try:
        copied = bool(json.loads(job).get("runtime_env", {}).get("working_dir"))
    except (ValueError, AttributeError):
        copied = False
    if copied:
        raise ConfigError(f"{key}={folder!r} is relative, and this job runs in Ray's temporary copy of its "
                          f"working dir ({os.getcwd()}), deleted when the job ends; give an absolute path, "
                          f"e.g. {key}=$PWD/{folder} on the machine that submits the job")


class GenerateConfig(Section):
    """``sliderl generate``: sample completions for a list of prompts and report KV usage."""

    RECIPE: ClassVar[str] = "generate-tiny.yaml"

    model: ModelSource = Field(default_factory=TinyModel)
    """Weights to load: ``type: tiny`` (built locally) or ``type: hf`` (a local directory)."""
    engine: EngineArgs = Field(default_factory=EngineArgs)
    """Engine construction arguments (``rollout.EngineArgs``)."""
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    """How every completion is sampled (``rollout.SamplingParams``); sample j of a prompt uses seed + j."""
    prompts: list[str] = Field(default_factory=lambda: ["Hello"], min_length=1)
    """Prompts to complete."""
    n: int = Field(1, ge=1)
    """Samples per prompt."""
    output_dir: str = Field(default_factory=run_folder("generate"))
    """Where config.yaml and completions.jsonl are written."""


def check_device(device: str, key: str) -> None:
    """``ConfigError`` when ``device`` (cpu | cuda | cuda:N) names a CUDA device this process's torch lacks."""
    if not device.startswith("cuda"):
        return
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    index = int(device.partition(":")[2] or 0)
    if index >= count:
        have = f"{count} CUDA device(s)" if count else f"no CUDA (torch {torch.__version__})"
        raise ConfigError(f"{key}={device} but this machine's torch has {have}; use {key}=cpu"
                          + (f" or cuda:0..cuda:{count - 1}" if count else ""))


# ------------------------------------------------------------------------------ load and save


def load_config(schema: type[Schema], path: str | None, overrides: list[str] = ()) -> Schema:
    """Read ``path`` (YAML; ``None``: the schema's default recipe), apply ``key.sub=value`` overrides, validate.

    Raises ``ConfigError`` with a message naming the bad key or value and what would be valid.
    """
    source = path if path is not None else default_recipe(schema)
    data = _read_yaml(source) if source is not None else {}
    for override in overrides:
        _apply_override(data, override)
    where = f"config {path!r}" if path is not None else "config"
    if overrides:
        where += f" with overrides {' '.join(overrides)!r}"
    chosen: dict[tuple, set] = {}
    try:
        check_keys(schema, data, (), chosen)
        return schema.model_validate(data)
    except ValueError as err:
        message = format_errors(err, data, chosen) if isinstance(err, ValidationError) else str(err)
        raise ConfigError(f"invalid {where}: {message}") from None


def default_recipe(schema: type[BaseModel]) -> str | None:
    """The YAML file a job runs when given none (``configs/<RECIPE>``), or None."""
    name = getattr(schema, "RECIPE", None)
    return str(RECIPES / name) if name else None


def save_config(cfg: BaseModel, path: str | os.PathLike) -> None:
    """Write the fully resolved ``cfg`` (defaults included) as YAML."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(to_yaml(cfg))


def to_yaml(cfg: BaseModel) -> str:
    """The fully resolved config as YAML text, in field order."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


def _read_yaml(path: str) -> dict:
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"config file {path!r} not found")
    try:
        data = yaml.safe_load(file.read_text())
    except yaml.YAMLError as err:
        raise ConfigError(f"config file {path!r} is not valid YAML: {' '.join(str(err).split())}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path!r} must hold a mapping of keys, got {type(data).__name__}")
    return data


def _apply_override(data: dict, override: str) -> None:
    """Set ``a.b.c=value`` in the nested dict ``data``; the value is parsed as YAML.

    Switching a variant (``model.type=hf`` over a file's ``type: tiny``) drops the file's other keys
    of that section: they belong to the other variant.
    """
    key, sep, text = override.partition("=")
    parts = key.strip().split(".")
    if not sep or not all(parts):
        raise ConfigError(f"malformed override {override!r}; expected key.sub=value, e.g. engine.block_size=32")
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        raise ConfigError(f"override {override!r}: value {text!r} is not valid YAML") from None
    if isinstance(value, dict) and not text.lstrip().startswith("{") and text.rstrip().endswith(":"):
        value = text.strip()  # "prefix_sliding:" is YAML for {prefix_sliding: null}; a mapping is written {k: v}
    node = data
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"override {override!r}: {'.'.join(parts[:i + 1])} holds a value, not a section")
        node = child
    last = parts[-1]
    if last == "type" and node.get(last, value) != value:
        node.clear()
    node[last] = value


# ------------------------------------------------------------------------------- key checking


def check_keys(annotation: Any, data: Any, path: tuple, chosen: dict[tuple, set]) -> None:
    """Raise ``ValueError`` for the first key of ``data`` that ``annotation`` does not define.

    Unions of sections are resolved by their ``type`` field (the first member when it is absent); the
    class picked for each path is recorded in ``chosen`` so that ``format_errors`` can drop the
    other members' complaints.
    """
    candidates = _sections(annotation)
    if not candidates or not isinstance(data, dict):
        return
    section = _pick(candidates, data, path)
    if len(candidates) > 1:
        chosen[path] = {section.__name__, _tag_value(section, "type")}
    where = ".".join(path) or "top level"
    field_types = _field_types(section)
    renamed = getattr(section, "RENAMED", {})  # old key -> its new spelling and why
    for key, value in data.items():
        if key in renamed:
            raise ValueError(f"{where}: key {key!r} is no longer valid; write {renamed[key]}")
        if key not in field_types:
            raise ValueError(f"{where}: {unknown_key_message(key, list(field_types))}")
        check_keys(field_types[key], value, (*path, key), chosen)


def _pick(candidates: list[type], data: dict, path: tuple) -> type:
    if len(candidates) == 1:
        return candidates[0]
    tags = {_tag_value(c, "type"): c for c in candidates}
    value = data.get("type", next(iter(tags)))
    if value not in tags:
        where = ".".join((*path, "type"))
        raise ValueError(f"{where} must be one of {', '.join(map(repr, tags))}, got {value!r}")
    return tags[value]


def _tag_value(section: type, tag: str) -> Any:
    if dataclasses.is_dataclass(section):
        return next(f.default for f in dataclasses.fields(section) if f.name == tag)
    return section.model_fields[tag].default


def _field_types(section: type) -> dict[str, Any]:
    if dataclasses.is_dataclass(section):
        hints = typing.get_type_hints(section)
        return {f.name: hints[f.name] for f in dataclasses.fields(section)}
    return {name: f.annotation for name, f in section.model_fields.items()}


def _sections(annotation: Any) -> list[type]:
    """The section classes (pydantic models or dataclasses) an annotation admits."""
    if isinstance(annotation, type) and (issubclass(annotation, BaseModel) or dataclasses.is_dataclass(annotation)):
        return [annotation]
    if typing.get_origin(annotation) is Annotated:
        return _sections(typing.get_args(annotation)[0])
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return [s for arg in typing.get_args(annotation) for s in _sections(arg)]
    return []


def format_errors(err: ValidationError, data: Any, chosen: dict[tuple, set] | None = None) -> str:
    """Pydantic's errors as ``key.path: message (got value)``, joined on one line.

    Errors from union members other than the one picked for a path (see ``check_keys``) are dropped.
    """
    lines = []
    for e in err.errors(include_url=False):
        if not _from_chosen_member(e["loc"], data, chosen or {}):
            continue
        where = _user_path(e["loc"], data, e["type"] == "missing")
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] not in ("missing", "value_error", "model_variant"):
            msg += f" (got {e['input']!r})"
        lines.append(f"{where}: {msg}")
    return "; ".join(dict.fromkeys(lines)) or str(err)


def _from_chosen_member(loc: tuple, data: Any, chosen: dict[tuple, set]) -> bool:
    kept: list[str] = []
    node, tag_next = data, () in chosen
    for part in loc:
        if isinstance(node, dict) and part in node:
            kept.append(str(part))
            node, tag_next = node[part], tuple(kept) in chosen
        elif tag_next:  # pydantic names the union member here: a tag or a class name
            if part not in chosen[tuple(kept)]:
                return False
            tag_next = False
    return True


def _user_path(loc: tuple, data: Any, missing: bool) -> str:
    """The error location as the user's key path; union tags (not keys in ``data``) are dropped."""
    kept: list[str] = []
    node = data
    for i, part in enumerate(loc):
        if isinstance(node, dict) and part in node:
            kept.append(str(part))
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and part < len(node):
            kept[-1:] = [f"{kept[-1] if kept else ''}[{part}]"]
            node = node[part]
        elif missing and i == len(loc) - 1:
            kept.append(str(part))
    return ".".join(kept) or "top level"


# ------------------------------------------------------------------------------------ help text


def config_reference(cfg: BaseModel | Any, prefix: str = "") -> list[str]:
    """One line per leaf key of a resolved config, ``key = value  docstring``: the values the job will use."""
    lines = []
    for name, value, doc in _entries(cfg):
        key = f"{prefix}{name}"
        if isinstance(value, BaseModel) or (dataclasses.is_dataclass(value) and not isinstance(value, type)):
            lines.extend(config_reference(value, key + "."))
        else:
            lines.append(f"{key} = {value!r}  {doc}")
    return lines


def _entries(cfg: Any) -> list[tuple[str, Any, str]]:
    if isinstance(cfg, BaseModel):
        return [(name, getattr(cfg, name), " ".join((field.description or "").split()))
                for name, field in type(cfg).model_fields.items()]
    docs = field_docs(type(cfg))
    return [(f.name, getattr(cfg, f.name), docs.get(f.name, "")) for f in dataclasses.fields(cfg)]


@cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a dataclass (its own and inherited ones), by field name."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__[:-1]):
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for node, after in zip(body, body[1:]):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr) \
                    and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str):
                docs[node.target.id] = " ".join(after.value.value.split())
    return docs
