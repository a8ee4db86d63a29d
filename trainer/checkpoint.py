"""Learner checkpoints: the model in Hugging Face layout plus a ``trainer_state.pt`` beside it.

A checkpoint directory holds ``config.json``, ``model.safetensors``, the tokenizer files (with any
``<reg_i>`` tokens the learner added) and ``generation_config.json`` when the source model had one —
loadable by ``transformers.AutoModelForCausalLM`` and ``rollout.loader.load_model`` — and
``trainer_state.pt``: optimizer state, version, RNG states and the learner's settings.
"""

from __future__ import annotations

import copy
import pickle
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

from rollout.loader import model_dir
from rollout.model import DecoderLM

TRAINER_STATE = "trainer_state.pt"
MODEL_FILE = "model.safetensors"
GENERATION_CONFIG = "generation_config.json"


def read_hf_source(source_dir: str | Path) -> tuple[Any, str | None]:
    """The HF config object and the generation_config.json text (or None) of the model directory a learner
    loads; kept in memory, so later checkpoints do not need that directory to exist any more."""
    from transformers import AutoConfig

    source = model_dir(source_dir)
    generation = source / GENERATION_CONFIG
    return (AutoConfig.from_pretrained(str(source), local_files_only=True),
            generation.read_text() if generation.is_file() else None)


def save_hf_model(model: DecoderLM, tokenizer, source: tuple[Any, str | None], out_dir: str | Path) -> None:
    """Write ``model`` (its current vocabulary size) with ``tokenizer`` to ``out_dir`` in HF layout.

    ``source``: ``read_hf_source`` of the directory the model was loaded from; its config is reused
    with ``vocab_size`` updated. Tied embeddings are stored once, as transformers stores them.
    """
    config, generation_text = copy.deepcopy(source[0]), source[1]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config.vocab_size = model.config.vocab_size
    config.save_pretrained(out)
    weights = {name: p.detach().to("cpu").contiguous() for name, p in model.named_parameters()}
    save_file(weights, str(out / MODEL_FILE), metadata={"format": "pt"})
    tokenizer.save_pretrained(str(out))
    if generation_text is not None:
        (out / GENERATION_CONFIG).write_text(generation_text)


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


def save_trainer_state(out_dir: str | Path, state: dict) -> None:
    torch.save(state, Path(out_dir) / TRAINER_STATE)


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
