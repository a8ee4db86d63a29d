"""Learner checkpoints: the model in Hugging Face layout plus a ``trainer_state.pt`` beside it.

A checkpoint directory holds ``config.json``, ``model.safetensors``, the tokenizer files (with any
``<reg_i>`` tokens the learner added) and ``generation_config.json`` when the source model had one —
loadable by ``transformers.AutoModelForCausalLM`` and ``core.loader.load_model`` — and
``trainer_state.pt``: optimizer state, version, RNG states and the learner's settings. The writers
return each file's size and sha256 for the checkpoint's manifest (``trainer.manifest``); the two big
files are hashed while they are written.
"""

from __future__ import annotations

import copy
import json
import pickle
import random
import struct
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from sliderl.core.loader import model_dir
from sliderl.core.model import DecoderLM
from sliderl.trainer.manifest import FileEntry, HashingWriter, Manifest, hash_file

TRAINER_STATE = "trainer_state.pt"
MODEL_FILE = "model.safetensors"
GENERATION_CONFIG = "generation_config.json"
HF_CONFIG = "config.json"
# safetensors dtype names in the order its reference writer sorts tensors by (descending): item sizes
# never grow along the file, so with the header padded to 8 bytes every tensor is aligned
SAFETENSORS_DTYPES = {torch.bool: "BOOL", torch.uint8: "U8", torch.int8: "I8", torch.int16: "I16",
                      torch.float16: "F16", torch.bfloat16: "BF16", torch.int32: "I32", torch.float32: "F32",
                      torch.float64: "F64", torch.int64: "I64"}
_DTYPE_RANK = {dtype: rank for rank, dtype in enumerate(SAFETENSORS_DTYPES)}


def read_hf_source(source_dir: str | Path) -> tuple[Any, str | None]:
    """The HF config object and the generation_config.json text (or None) of the model directory a learner
    loads; kept in memory, so later checkpoints do not need that directory to exist any more."""
    from transformers import AutoConfig

    source = model_dir(source_dir)
    generation = source / GENERATION_CONFIG
    return (AutoConfig.from_pretrained(str(source), local_files_only=True),
            generation.read_text() if generation.is_file() else None)


def save_hf_model(model: DecoderLM, tokenizer, source: tuple[Any, str | None], out_dir: str | Path,
                  weights: dict[str, torch.Tensor] | None = None) -> Manifest:
    """Write ``model`` (its current vocabulary size) with ``tokenizer`` to ``out_dir`` in HF layout.

    ``source``: ``read_hf_source`` of the directory the model was loaded from; its config is reused
    with ``vocab_size`` updated. Tied embeddings are stored once, as transformers stores them.
    ``weights``: the tensors to write by HF name (a sharded model's gathered weights); default the
    model's parameters. Returns the entries of the files written.
    """
    config, generation_text = copy.deepcopy(source[0]), source[1]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config.vocab_size = model.config.vocab_size
    config.save_pretrained(out)
    small = [out / HF_CONFIG] + [Path(f) for f in tokenizer.save_pretrained(str(out))]
    if generation_text is not None:
        (out / GENERATION_CONFIG).write_text(generation_text)
        small.append(out / GENERATION_CONFIG)
    manifest = Manifest({f.name: hash_file(f) for f in small if f.is_file()})
    weights = dict(model.named_parameters()) if weights is None else weights
    manifest.add(MODEL_FILE, write_safetensors(out / MODEL_FILE, weights, metadata={"format": "pt"}))
    return manifest


def write_safetensors(path: str | Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> FileEntry:
    """Write ``tensors`` (on any device) to ``path`` in the safetensors format, one tensor at a time, and
    return the file's entry, hashed while writing.

    The bytes are those ``safetensors.torch.save_file`` writes: the header's length (8 bytes, little
    endian), the JSON header (``__metadata__``, then per tensor its dtype, shape and data_offsets) padded
    with spaces to a multiple of 8, then the tensors' raw bytes, sorted by dtype (descending) then
    name. Only one tensor at a time is copied to the CPU, and no whole-file buffer is built.
    """
    order = sorted(tensors, key=lambda name: (-_DTYPE_RANK[tensors[name].dtype], name))
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name in order:
        t = tensors[name]
        end = offset + t.numel() * t.element_size()
        header[name] = {"dtype": SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, end]}
        offset = end
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    with HashingWriter(path) as out:
        out.write(struct.pack("<Q", len(text)))
        out.write(text)
        for name in order:
            out.write(_raw_bytes(tensors[name]))
    return out.entry()


def _raw_bytes(t: torch.Tensor) -> np.ndarray:
    """The tensor's elements row-major as bytes, on the CPU (this machine's order: little endian)."""
    assert sys.byteorder == "little", "safetensors stores little-endian values"
    return t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()


def rng_state() -> dict:
    """Every RNG the learner process may draw from, as tensors and plain values only (see ``load_trainer_state``)."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "numpy": (name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached))}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_trainer_state(out_dir: str | Path, state: dict) -> FileEntry:
    """``torch.save(state)`` as ``out_dir/trainer_state.pt``; its entry, hashed while writing."""
    with HashingWriter(Path(out_dir) / TRAINER_STATE) as out:
        torch.save(state, out)
    return out.entry()


def load_trainer_state(path: str | Path) -> dict:
    """The ``trainer_state.pt`` of checkpoint directory ``path``, read with ``weights_only=True``.

    The file holds only tensors and plain values (numbers, strings, tuples, lists, dicts), so loading
    it never runs code: a file holding anything else (a crafted pickle) is refused, not unpickled.
    """
    file = Path(path) / TRAINER_STATE
    if not file.is_file():
        raise FileNotFoundError(f"no {TRAINER_STATE} in {str(path)!r}; it is not a learner checkpoint "
                                "(save one with Learner.save_checkpoint)")
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise ValueError(f"{file} holds objects other than tensors and plain values, so it was not loaded "
                         f"(loading could run code; checkpoints written before this check stored NumPy RNG "
                         f"state this way): {str(err).splitlines()[0]}") from None
