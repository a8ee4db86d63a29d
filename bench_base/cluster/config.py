"""The config schema: pydantic models that document themselves, loaded from YAML plus overrides.

Every section forbids unknown keys and names the valid ones; every field carries its docstring and
its bounds. A job's config is one top-level model (``GenerateConfig`` for ``sliderl generate``)
whose defaults are a runnable job. ``load_config`` reads a YAML file and applies ``key.sub=value``
overrides (each value parsed as YAML, so ``engine.block_size=32`` is an int and
``sampling.stop=[a,b]`` a list); ``save_config`` writes the fully resolved config back as YAML.
"""

from __future__ import annotations

import difflib
import os
import re
import shutil
import time
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError, field_validator, model_validator

from rollout.kv_policy import KVPolicy

DEFAULT_MODEL_CACHE = "~/.cache/sliderl/models"
DEFAULT_PROMPTS = [
    "The capital of France is",
    "Once upon a time,",
    "Question: what is 12 + 30? Answer:",
]

Schema = TypeVar("Schema", bound=BaseModel)


class ConfigError(ValueError):
    """A config the user wrote (file, override or value) is invalid; the message says how."""


class Section(BaseModel):
    """Base of every config model: unknown keys are errors that list the valid keys."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_default=True)

    @model_validator(mode="before")
    @classmethod
    def _known_keys(cls, data: Any) -> Any:
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


# --------------------------------------------------------------------------------------- model


class TinyModel(Section):
    """A small random-weight model the project builds locally (no downloads)."""

    type: Literal["tiny"] = "tiny"
    """Variant tag: a locally built random-weight model."""
    arch: Literal["qwen3", "qwen2", "llama"] = "qwen3"
    """Architecture family of the tiny model."""
    hidden_size: int = Field(64, ge=8)
    """Width of the residual stream; divisible by num_heads."""
    num_layers: int = Field(2, ge=1)
    """Number of decoder layers."""
    num_heads: int = Field(4, ge=1)
    """Query heads per layer."""
    num_kv_heads: int = Field(2, ge=1)
    """Key/value heads per layer (GQA); divides num_heads."""
    intermediate_size: int = Field(128, ge=1)
    """Width of the MLP."""
    seed: int = Field(0, ge=0)
    """Seed of the random weights."""
    cache_dir: str = DEFAULT_MODEL_CACHE
    """Folder that holds built tiny models; one subfolder per parameter set, built when missing."""

    @model_validator(mode="after")
    def _heads_fit(self) -> TinyModel:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_kv_heads ({self.num_kv_heads}) must divide num_heads ({self.num_heads})")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must divide hidden_size ({self.hidden_size})")
        return self

    @property
    def name(self) -> str:
        """Folder name derived from every parameter that changes the weights or the shapes."""
        return (f"tiny-{self.arch}-h{self.hidden_size}-l{self.num_layers}-q{self.num_heads}"
                f"-kv{self.num_kv_heads}-i{self.intermediate_size}-s{self.seed}")

    def resolve(self) -> str:
        """Path of the model directory, building it (atomically) when it is not there yet."""
        path = Path(self.cache_dir).expanduser() / self.name
        if not (path / "config.json").is_file():
            self._build(path)
        return str(path)

    def _build(self, path: Path) -> None:
        from rollout.tiny import make_tiny_model

        path.parent.mkdir(parents=True, exist_ok=True)
        staging = path.parent / f".{path.name}.building-{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        make_tiny_model(
            str(staging), arch=self.arch, hidden_size=self.hidden_size, num_layers=self.num_layers,
            num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
            intermediate_size=self.intermediate_size, seed=self.seed,
        )
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


# -------------------------------------------------------------------------------------- engine


class EngineConfig(Section):
    """Arguments of the generation engine (``rollout.LLM``)."""

    kv: str = "prefix_sliding:64"
    """KV retention policy: full, prefix_sliding:W, sliding_window:W, streaming:S:W or registers:N."""
    block_size: int = Field(16, ge=1)
    """Token slots per KV block."""
    num_blocks: int | None = Field(None, ge=1)
    """Blocks in the KV pool; None sizes the pool from kv_cache_gb."""
    kv_cache_gb: float | None = Field(None, gt=0)
    """KV pool size in GiB when num_blocks is None; None lets the engine choose."""
    max_num_seqs: int = Field(64, ge=1)
    """Most sequences scheduled in one engine step."""
    max_num_batched_tokens: int = Field(1024, ge=1)
    """Most tokens (prefill + decode) in one engine step."""
    max_model_len: int | None = Field(None, ge=1)
    """Longest sequence (prompt + completion); None takes the model's own limit."""
    device: str = "cpu"
    """Where the engine runs: cpu, cuda or cuda:N."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Weight and KV dtype."""
    seed: int = 0
    """Engine seed; requests without their own seed derive one from it and their index."""

    @field_validator("kv")
    @classmethod
    def _canonical_kv(cls, spec: str) -> str:
        return KVPolicy.parse(spec).spec

    @field_validator("device")
    @classmethod
    def _known_device(cls, device: str) -> str:
        if not re.fullmatch(r"cpu|cuda(:\d+)?", device):
            raise ValueError(f"device must be cpu, cuda or cuda:N, got {device!r}")
        return device

    def llm_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``rollout.LLM`` (everything but ``model``)."""
        return self.model_dump()


# ------------------------------------------------------------------------------------ sampling


class SamplingConfig(Section):
    """Per-request sampling; mirrors ``rollout.sampling.SamplingParams``."""

    max_tokens: int = Field(256, ge=1)
    """Most tokens to generate per request."""
    temperature: float = Field(1.0, ge=0)
    """Softmax temperature; 0 means greedy."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus mass in (0, 1]; 1 = off."""
    top_k: int = Field(-1, ge=-1)
    """Keep only the k most likely tokens (>= 1); -1 = off."""
    seed: int | None = None
    """Request seed; sample j of a prompt uses seed + j. None derives seeds from engine.seed."""
    stop: list[str] = []
    """Stop strings; the completion ends before the first one."""
    stop_token_ids: list[int] = []
    """Token ids that end a request."""
    ignore_eos: bool = False
    """Keep generating past the end-of-sequence token."""
    max_thinking_tokens: int | None = Field(None, ge=1)
    """Budget forcing: after this many thinking tokens force think_end; None = no cap."""
    think_end: str = Field("</think>", min_length=1)
    """Text forced when the thinking budget runs out."""

    @field_validator("top_k")
    @classmethod
    def _top_k_off_or_positive(cls, top_k: int) -> int:
        if top_k == 0:
            raise ValueError("top_k must be -1 (off) or >= 1, got 0")
        return top_k

    def params(self, sample_index: int = 0):
        """``rollout.sampling.SamplingParams`` for sample ``sample_index`` of a prompt."""
        from rollout.sampling import SamplingParams

        fields = self.model_dump()
        if self.seed is not None:
            fields["seed"] = self.seed + sample_index
        return SamplingParams(**fields)


# ----------------------------------------------------------------------------------- generate


def _default_output_dir() -> str:
    return f"runs/generate-{time.strftime('%Y%m%d-%H%M%S')}"


class GenerateConfig(Section):
    """``sliderl generate``: sample completions for a list of prompts and report KV usage."""

    model: ModelSource = Field(default_factory=TinyModel)
    """Weights to load: ``type: tiny`` (built locally) or ``type: hf`` (a local directory)."""
    engine: EngineConfig = Field(default_factory=EngineConfig)
    """Engine construction arguments."""
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    """How every completion is sampled."""
    prompts: list[str] = Field(default_factory=lambda: list(DEFAULT_PROMPTS), min_length=1)
    """Prompts to complete."""
    n: int = Field(2, ge=1)
    """Samples per prompt."""
    output_dir: str = Field(default_factory=_default_output_dir)
    """Where config.yaml and completions.jsonl are written."""


# ------------------------------------------------------------------------------ load and save


def load_config(schema: type[Schema], path: str | None, overrides: list[str] = ()) -> Schema:
    """Read ``path`` (YAML; ``None`` = all defaults), apply ``key.sub=value`` overrides, validate.

    Raises ``ConfigError`` with a message naming the bad key or value and what would be valid.
    """
    data = _read_yaml(path) if path is not None else {}
    for override in overrides:
        _apply_override(data, override)
    try:
        return schema.model_validate(data)
    except ValidationError as err:
        source = f"config {path!r}" if path is not None else "config"
        if overrides:
            source += f" with overrides {' '.join(overrides)!r}"
        raise ConfigError(f"invalid {source}: {format_errors(err, data)}") from None


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
    """Set ``a.b.c=value`` in the nested dict ``data``; the value is parsed as YAML."""
    key, sep, text = override.partition("=")
    parts = key.strip().split(".")
    if not sep or not all(parts):
        raise ConfigError(f"malformed override {override!r}; expected key.sub=value, e.g. engine.block_size=32")
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        raise ConfigError(f"override {override!r}: value {text!r} is not valid YAML") from None
    node = data
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {override!r}: {'.'.join(parts[:i + 1])} holds a value, not a section")
        node = child
    node[parts[-1]] = value


def format_errors(err: ValidationError, data: Any) -> str:
    """Pydantic's errors as ``key.path: message (got value)``, joined on one line."""
    lines = []
    for e in err.errors(include_url=False):
        where = _user_path(e["loc"], data, e["type"] == "missing")
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] not in ("missing", "value_error", "model_variant"):
            msg += f" (got {e['input']!r})"
        lines.append(f"{where}: {msg}")
    return "; ".join(lines)


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


def config_reference(schema: type[BaseModel], prefix: str = "", variant: str = "") -> list[str]:
    """One line per leaf key, ``key = default  docstring``, for help text."""
    lines = []
    for name, field in schema.model_fields.items():
        key = f"{prefix}{name}"
        sections = _sections(field.annotation)
        for section in sections:
            tag = section.model_fields.get("type") if len(sections) > 1 else None
            lines.extend(config_reference(section, key + ".", f" (type={tag.default})" if tag else ""))
        if not sections:
            default = "<required>" if field.is_required() else repr(field.get_default(call_default_factory=True))
            lines.append(f"{key}{variant} = {default}  {field.description or ''}")
    return lines


def _sections(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    args = getattr(annotation, "__args__", ()) or ()
    metadata = getattr(annotation, "__metadata__", None)
    if metadata is not None:  # Annotated[X, ...]
        return _sections(annotation.__origin__)
    return [s for arg in args for s in _sections(arg)]
