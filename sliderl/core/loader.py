"""Load a ``DecoderLM`` and its tokenizer from a local Hugging Face model directory.

A model directory holds ``config.json`` and its weights as ``model.safetensors`` or as shards listed
by ``model.safetensors.index.json``. Nothing is downloaded: every lookup is ``local_files_only``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from sliderl.core.model import DecoderLM, ModelConfig

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}  # name -> parameter dtype


def load_model(path: str | Path, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> DecoderLM:
    """Build a ``DecoderLM`` from the HF directory ``path`` with parameters in ``dtype`` on ``device``.

    The module is built on the meta device and materialised once on ``device``, so a large model is
    never allocated twice. Raises FileNotFoundError / ValueError naming ``path`` for a missing
    directory, config, weights or shard, an unsupported architecture, or a tensor the model needs
    that the checkpoint lacks.
    """
    root = model_dir(path)
    config = read_config(root)
    files = weight_files(root)
    with torch.device("meta"):
        model = DecoderLM(config)
    model.to(dtype)  # free on meta; keeps the rotary frequencies in float32
    check_complete(root, model, files)
    model.to_empty(device=device)
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as shard:
            model.load_weights((name, shard.get_tensor(name)) for name in shard.keys())
    return model.eval()


def load_tokenizer(path: str | Path):
    """The tokenizer saved in the HF directory ``path`` (``AutoTokenizer``, local files only)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir(path)), local_files_only=True)


def model_dir(path: str | Path) -> Path:
    """``path`` as a Path, checked to be an existing directory."""
    root = Path(path).expanduser()
    if not root.exists():
        raise FileNotFoundError(f"model path {str(root)!r} does not exist; expected a local Hugging Face "
                                "model directory (config.json + safetensors weights + tokenizer)")
    if not root.is_dir():
        raise FileNotFoundError(f"model path {str(root)!r} is a file; expected a local Hugging Face model directory")
    return root


def read_config(root: Path) -> ModelConfig:
    """``ModelConfig`` from ``root/config.json``."""
    from transformers import AutoConfig

    if not (root / "config.json").is_file():
        raise FileNotFoundError(f"no config.json in model directory {str(root)!r}")
    try:
        hf_config = AutoConfig.from_pretrained(str(root), local_files_only=True)
        return ModelConfig.from_hf(hf_config)
    except ValueError as err:
        raise ValueError(f"cannot load model config from {str(root)!r}: {err}") from err


def weight_files(root: Path) -> list[Path]:
    """The safetensors files holding the model's weights, each checked to exist."""
    if (root / SINGLE_FILE).is_file():
        return [root / SINGLE_FILE]
    index = root / INDEX_FILE
    if not index.is_file():
        raise FileNotFoundError(f"no safetensors weights in model directory {str(root)!r}; "
                                f"expected {SINGLE_FILE} or {INDEX_FILE} with its shards")
    weight_map = json.loads(index.read_text()).get("weight_map")
    if not isinstance(weight_map, dict):
        raise ValueError(f"{str(index)!r} has no 'weight_map' object mapping tensor names to shard files")
    files = [root / name for name in sorted(set(weight_map.values()))]
    for file in files:
        if not file.is_file():
            raise FileNotFoundError(f"shard {file.name!r} named in {str(index)!r} is missing from {str(root)!r}")
    return files


def check_complete(root: Path, model: DecoderLM, files: list[Path]) -> None:
    """Raise ValueError when the checkpoint lacks any tensor the model needs (reads headers only)."""
    present: set[str] = set()
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as shard:
            present.update(shard.keys())
    missing = [name for name in model.weight_names() if name not in present]
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ValueError(f"checkpoint in {str(root)!r} lacks tensors the {model.config.model_type} model needs: {shown}")
