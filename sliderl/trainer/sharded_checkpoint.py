"""The training state of a sharded learner as a ``torch.distributed.checkpoint`` (DCP) shard set, and the
conversions that let a run saved at N ranks resume at M (N != M, one included).

Beside the consolidated Hugging Face weights, an FSDP2 learner's checkpoint folder holds DCP's
``.metadata`` and one ``__<rank>_0.distcp`` per rank with, by parameter name: the sharded parameters as
the optimizer steps them (``model.*``: float32 masters under ``master_weights``) and AdamW's tensors
(``optim.state.*``: step, exp_avg, exp_avg_sq). ``trainer_state.pt`` carries the rest (version, RNG,
settings, AdamW's ``param_groups`` with parameter names) and ``OPTIMIZER_SHARDS: True``.

DCP does the resharding: any number of ranks loads the set into its own shards. One process without a
process group reads the whole set (``read_full``). A one-rank checkpoint's optimizer state is keyed by
parameter index (``torch.optim``'s own ``state_dict``, with ``master_weights`` for ``MasterAdamW``);
``by_name`` / ``by_index`` convert between the two keyings.

Only tensors go into the shard set, and the metadata file (a pickle) is read with an unpickler that
admits DCP's own metadata records and nothing else, so loading a checkpoint never runs code (as
``trainer.checkpoint.load_trainer_state`` promises for ``trainer_state.pt``).
"""

from __future__ import annotations

import io
import pickle
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import StorageMeta

OPTIMIZER_SHARDS = "optimizer_shards"  # trainer_state.pt key: the optimizer state is the folder's DCP set
METADATA = ".metadata"


def shard_files(folder: str | Path, rank: int) -> list[Path]:
    """The files rank ``rank`` writes into ``folder`` (rank 0 adds the metadata)."""
    folder = Path(folder)
    files = sorted(folder.glob(f"__{rank}_*.distcp"))
    return files + ([folder / METADATA] if rank == 0 else [])


def save_shards(folder: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> list[dict]:
    """Write this rank's shards of the model and the optimizer state (a collective: every rank calls it);
    returns AdamW's ``param_groups`` keyed by parameter name (they go into ``trainer_state.pt``)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    state: dict[str, Any] = {"model": get_model_state_dict(model)}
    groups = []
    if optimizer.state:  # an optimizer that never stepped has no state (and reading it would create some)
        optim = get_optimizer_state_dict(model, optimizer)
        state["optim"] = {"state": optim["state"]}
        groups = optim["param_groups"]
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(folder), thread_count=1))
    return groups


def load_shards(folder: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                param_groups: list[dict]) -> None:
    """Load a shard set written at any number of ranks into this rank's shards (a collective)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    keys = set(read_metadata(folder).state_dict_metadata)
    state: dict[str, Any] = {"model": get_model_state_dict(model)}
    if param_groups:
        missing = [f"optim.state.{k}" for k in _optim_keys(model, optimizer) if f"optim.state.{k}" not in keys]
        if missing:
            raise ValueError(f"the optimizer shards in {folder} lack {missing[:3]}; they were saved for another model")
        state["optim"] = {"state": get_optimizer_state_dict(model, optimizer)["state"]}
    dcp.load(state, storage_reader=SafeReader(folder))
    set_model_state_dict(model, state["model"])
    if param_groups:
        set_optimizer_state_dict(model, optimizer, {"state": state["optim"]["state"], "param_groups": param_groups})


def _optim_keys(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return [f"{name}.{k}" for name, s in get_optimizer_state_dict(model, optimizer)["state"].items() for k in s]


def read_full(folder: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]:
    """The whole shard set in this process, no process group: (parameters by name, AdamW state by name)."""
    import torch.distributed.checkpoint as dcp

    metadata = read_metadata(folder)
    flat = {key: torch.empty(entry.size, dtype=entry.properties.dtype)
            for key, entry in metadata.state_dict_metadata.items()}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(flat, storage_reader=SafeReader(folder), no_dist=True)
    weights: dict[str, torch.Tensor] = {}
    adamw: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in flat.items():
        path = metadata.planner_data[key]  # the nesting DCP flattened: ("model", name), ("optim", "state", name, k)
        if path[0] == "model":
            weights[path[1]] = tensor
        else:
            adamw.setdefault(path[2], {})[path[3]] = tensor
    return weights, adamw


def by_name(state_dict: dict, names: list[str]) -> tuple[dict[str, dict], list[dict]]:
    """A ``torch.optim`` state dict keyed by parameter index -> (state by name, param_groups naming them);
    ``names[i]`` is parameter i (the order of ``model.parameters()``)."""
    state = {names[i]: dict(s) for i, s in state_dict["state"].items()}
    groups = [{**g, "params": [names[i] for i in g["params"]]} for g in state_dict["param_groups"]]
    return state, groups


def by_index(state: dict[str, dict], param_groups: list[dict], names: list[str]) -> dict:
    """The inverse of ``by_name``: a state dict ``torch.optim.Optimizer.load_state_dict`` takes."""
    index = {name: i for i, name in enumerate(names)}
    unknown = sorted(set(state) - set(index))
    if unknown:
        raise ValueError(f"optimizer state for parameters this model lacks: {unknown[:3]}")
    return {"state": {index[name]: dict(s) for name, s in state.items()},
            "param_groups": [{**g, "params": [index[name] for name in g["params"]]} for g in param_groups]}


def set_full_state(model: nn.Module, optimizer: torch.optim.Optimizer, weights: dict[str, torch.Tensor] | None,
                   state: dict[str, dict], param_groups: list[dict]) -> None:
    """Shard full (unsharded) values into this rank's parameters and optimizer state: ``weights`` (None:
    keep the loaded ones) and AdamW's state by name. Every rank passes the same full values."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, strict=False)
    if weights is not None:
        set_model_state_dict(model, weights, options=options)
    if state:
        set_optimizer_state_dict(model, optimizer, {"state": state, "param_groups": param_groups}, options=options)


# ---------------------------------------------------------------------------------- safe metadata


def _admitted() -> dict[tuple[str, str], Any]:
    import pathlib

    from torch.distributed.checkpoint import filesystem, metadata
    from torch.serialization import _get_layout

    names = {("torch.distributed.checkpoint.metadata", n): getattr(metadata, n)
             for n in ("Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
                       "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")}
    names[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = filesystem._StorageInfo
    names[("torch.serialization", "_get_layout")] = _get_layout
    names[("torch", "Size")] = torch.Size
    names.update({("pathlib", n): getattr(pathlib, n) for n in ("PosixPath", "PurePosixPath", "WindowsPath",
                                                                "PureWindowsPath")})
    names.update({("torch", n): v for n, v in vars(torch).items()
                  if isinstance(v, (torch.dtype, torch.memory_format, torch.layout))})
    names.update({("collections", "OrderedDict"): __import__("collections").OrderedDict})
    return names


class _MetadataUnpickler(pickle.Unpickler):
    admitted: dict[tuple[str, str], Any] = {}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in self.admitted:
            raise pickle.UnpicklingError(f"{module}.{name} is not a DCP metadata record")
        return self.admitted[(module, name)]


def read_metadata(folder: str | Path):
    """DCP's ``.metadata`` of ``folder``, unpickled admitting DCP's metadata records only; a set holding
    anything but tensors is refused (DCP would unpickle those entries when loading)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    _MetadataUnpickler.admitted = _MetadataUnpickler.admitted or _admitted()
    path = Path(folder) / METADATA
    try:
        metadata = _MetadataUnpickler(io.BytesIO(path.read_bytes())).load()
    except pickle.UnpicklingError as err:
        raise ValueError(f"{path} holds objects other than DCP's metadata records, so it was not loaded "
                         f"(loading could run code): {err}") from None
    others = [k for k, v in metadata.state_dict_metadata.items() if not isinstance(v, TensorStorageMetadata)]
    if others:
        raise ValueError(f"{path} lists non-tensor entries {others[:3]}; a learner's shard set holds tensors only")
    return metadata


class SafeReader(FileSystemReader):
    """DCP's file reader whose metadata is read by ``read_metadata`` (DCP's own metadata records only)."""

    def __init__(self, folder: str | Path):
        super().__init__(str(folder))
        self.folder = Path(folder)

    def read_metadata(self, *args, **kwargs):
        metadata = read_metadata(self.folder)
        metadata.storage_meta = metadata.storage_meta or StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
