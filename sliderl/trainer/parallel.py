"""A learner over N ranks: the process group, FSDP2 applied to a plain ``DecoderLM``, and the step's data split.

The one module a learner actor calls to go parallel; ``Learner`` stays the same class at one rank and at
N, and asks its ``Parallel`` for everything that differs:

- ``Parallel``: one process and the plain model (today's learner, unchanged: no process group, no wrapping).
- ``FSDPParallel``: one rank of a ``torch.distributed`` process group (gloo on CPU, NCCL on GPU with gloo
  beside it for CPU tensors). ``parallelize`` applies PyTorch's FSDP2 (``fully_shard``) to each decoder
  layer, then to the root, so parameters, gradients and AdamW's state are split N ways; with
  ``master_weights`` the sharded parameters are float32 and the layers compute in ``dtype``
  (``MixedPrecisionPolicy``: the masters are FSDP2's own sharded parameters); ``offload='cpu'`` is FSDP2's
  ``CPUOffloadPolicy``.

The data split (``split``): every rank receives all of a step's groups and runs the algorithm's
deterministic ``select`` on all of them, so each knows the step's global totals (the loss normaliser);
``balanced_partition`` then deals the atomic units (a window, or a BoNBoN pair) to ranks by token count,
every unit to exactly one rank. FSDP2 collectives sit inside every forward and backward, so every rank
runs as many micro-batches as the busiest one, padding with zero-weight ones. Gradients are *summed*
over ranks (FSDP2 averages by default): each micro-batch loss is already its share of one global loss.
Gradient-norm clipping uses the global norm.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from sliderl.core.loader import DTYPES
from sliderl.core.model import FusedLinears
from sliderl.trainer.manifest import FileEntry, hash_file
from sliderl.trainer.optimizer import MasterAdamW


@dataclass(frozen=True)
class ProcessGroupSpec:
    """How the learner ranks meet: rank 0's rendezvous store (``host:port``), the world size, the
    ``torch.distributed`` backend, how long any collective may wait before it is an error, and how many
    consecutive ranks shard one copy of the state (None: all of them)."""

    address: str
    world_size: int
    backend: str
    timeout_s: float
    shard_size: int | None = None


def process_group_backend(device: str) -> str:
    """gloo on CPU; on GPU NCCL for CUDA tensors and gloo for CPU ones (CPU offload, metrics)."""
    return "cpu:gloo,cuda:nccl" if device.startswith("cuda") else "gloo"


def open_rendezvous(host: str):
    """A rendezvous store served by this process (rank 0) on a free port of ``host``: (store, ``host:port``)."""
    import torch.distributed as dist

    store = dist.TCPStore(host, 0, None, True, timeout=datetime.timedelta(seconds=300), wait_for_workers=False)
    return store, f"{host}:{store.port}"


def balanced_partition(sizes: list[int], num_parts: int) -> list[list[int]]:
    """Indices of ``sizes`` dealt to ``num_parts`` parts by load, each index to exactly one part.

    Largest first (ties by index), each to the part with the least load so far (ties by part index);
    every part's indices come back in ascending order. Deterministic: every rank computes the same deal.
    """
    loads, parts = [0] * num_parts, [[] for _ in range(num_parts)]
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        part = min(range(num_parts), key=lambda p: (loads[p], p))
        parts[part].append(i)
        loads[part] += sizes[i]
    return [sorted(p) for p in parts]


class Parallel:
    """One process and the plain model: nothing is wrapped, split or reduced."""

    rank: int = 0
    world_size: int = 1
    sharded: bool = False
    optimizer_foreach: bool | None = None  # AdamW's foreach kernels: torch's choice

    def storage_dtype(self, dtype: str, master_weights: bool) -> torch.dtype:
        """The dtype the model's parameters are loaded in."""
        return DTYPES[dtype]

    def load_device(self, device: torch.device) -> torch.device:
        """Where the model is loaded before ``parallelize``."""
        return device

    def parallelize(self, model: nn.Module, dtype: str, master_weights: bool, reduce_dtype: str,
                    offload: str) -> nn.Module:
        return model

    def set_gradient_sync(self, model: nn.Module, sync: bool) -> None:
        """Whether the next backward sums its gradients over ranks into the shards (else they accumulate
        unsharded until one that does); here there is nothing to sum."""

    def split(self, sizes: list[int]) -> list[list[int]]:
        """Each rank's unit indices (``sizes``: each unit's tokens); here all of them."""
        return [list(range(len(sizes)))]

    def gather(self, value: Any) -> list[Any]:
        """``value`` of every rank, in rank order (a picklable object)."""
        return [value]

    def clip_grad_norm(self, parameters: Iterable[Tensor], max_norm: float) -> float:
        """Clip the gradients to ``max_norm`` by their global norm; the norm before clipping."""
        return float(torch.nn.utils.clip_grad_norm_(parameters, max_norm))

    def weight_segments(self, model: nn.Module) -> Iterator[dict[str, Tensor]]:
        """The model's full weights by HF name, in segments; a segment's tensors are valid until the next
        is asked for (copy what you keep). Here one segment, the parameters themselves."""
        yield {name: p.detach() for name, p in model.named_parameters()}

    def gather_weights(self, model: nn.Module) -> dict[str, Tensor]:
        """The full weights by HF name where the consolidated checkpoint is written (rank 0); here the
        parameters themselves, uncopied."""
        return dict(next(self.weight_segments(model)))

    def save_training_state(self, folder: Path, model: nn.Module,
                            optimizer: torch.optim.Optimizer) -> tuple[dict, dict[str, FileEntry]]:
        """What ``trainer_state.pt`` holds of the optimizer, and the files written for it (every rank's,
        complete on rank 0). Here ``torch.optim``'s own state dict, keyed by parameter index."""
        return {"optimizer": optimizer.state_dict()}, {}

    def load_training_state(self, folder: Path, state: dict, model: nn.Module,
                            optimizer: torch.optim.Optimizer) -> None:
        """Load the optimizer state (and float32 masters) of a checkpoint saved at any number of ranks."""
        from sliderl.trainer.sharded_checkpoint import OPTIMIZER_SHARDS, by_index, by_name, read_full

        if OPTIMIZER_SHARDS not in state:
            optimizer.load_state_dict(state["optimizer"])
            return
        weights, adamw = read_full(folder)  # saved sharded: the whole set, keyed by parameter name
        names = [name for name, _ in model.named_parameters()]
        saved = by_index(adamw, state["param_groups"] or by_name(optimizer.state_dict(), names)[1], names)
        if isinstance(optimizer, MasterAdamW):  # the masters were the sharded float32 parameters
            saved["master_weights"] = [weights[name].float() for name in names]
        optimizer.load_state_dict(saved)

    def barrier(self) -> None:
        pass


class FSDPParallel(Parallel):
    """Rank ``rank`` of a process group of ``world_size`` learner ranks, training an FSDP2-sharded model."""

    sharded = True
    # AdamW one parameter at a time: its foreach kernels hold a temporary as large as all the moments (4 bytes
    # per parameter: 28 GiB for a 7B model on one GPU, where the state alone is 113 GiB)
    optimizer_foreach = False

    def __init__(self, mesh, rank: int, world_size: int):
        self.mesh, self.rank, self.world_size = mesh, rank, world_size

    @classmethod
    def join(cls, spec: ProcessGroupSpec, rank: int, device: torch.device, store=None) -> FSDPParallel:
        """Join the process group ``spec`` as ``rank`` (rank 0 passes the store it opened) and build the mesh.

        ``device``: the rank's device; ``cuda`` means the process's current GPU (Ray shows each actor its own).
        """
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        timeout = datetime.timedelta(seconds=spec.timeout_s)
        if store is None:
            host, port = spec.address.rsplit(":", 1)
            store = dist.TCPStore(host, int(port), spec.world_size, False, timeout=timeout)
        if device.type == "cuda":
            torch.cuda.set_device(device if device.index is not None else torch.cuda.current_device())
        dist.init_process_group(spec.backend, store=store, rank=rank, world_size=spec.world_size, timeout=timeout)
        shard = spec.shard_size or spec.world_size
        if shard >= spec.world_size:
            return cls(init_device_mesh(device.type, (spec.world_size,)), rank, spec.world_size)
        # HSDP: each row of consecutive ranks shards one copy; the copies' gradients are summed across rows
        mesh = init_device_mesh(device.type, (spec.world_size // shard, shard), mesh_dim_names=("replicate", "shard"))
        return cls(mesh, rank, spec.world_size)

    def storage_dtype(self, dtype: str, master_weights: bool) -> torch.dtype:
        # master weights: the sharded parameters themselves are the float32 masters
        return torch.float32 if master_weights else DTYPES[dtype]

    def load_device(self, device: torch.device) -> torch.device:
        return torch.device("cpu")  # fully_shard moves one module at a time to the device, then shards it

    def parallelize(self, model: nn.Module, dtype: str, master_weights: bool, reduce_dtype: str,
                    offload: str) -> nn.Module:
        """FSDP2 on each decoder layer, then the root (embeddings, final norm, LM head)."""
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        _drop_fused_weights(model)
        compute = DTYPES[dtype]
        mp = MixedPrecisionPolicy(param_dtype=compute if master_weights and compute != torch.float32 else None,
                                  reduce_dtype=DTYPES[reduce_dtype])
        policy = CPUOffloadPolicy() if offload == "cpu" else OffloadPolicy()
        for layer in model.model.layers:
            fully_shard(layer, mesh=self.mesh, mp_policy=mp, offload_policy=policy)
        fully_shard(model, mesh=self.mesh, mp_policy=mp, offload_policy=policy)
        for _, module in fsdp_modules(model):
            module.set_gradient_divide_factor(1.0)  # sum over ranks: each loss is a share of one global loss
            module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
        return model

    def set_gradient_sync(self, model: nn.Module, sync: bool) -> None:
        model.set_requires_gradient_sync(sync)  # every FSDP2 unit of the model (recurse)

    def split(self, sizes: list[int]) -> list[list[int]]:
        return balanced_partition(sizes, self.world_size)

    def gather(self, value: Any) -> list[Any]:
        import torch.distributed as dist

        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, value)
        return out

    def clip_grad_norm(self, parameters: Iterable[Tensor], max_norm: float) -> float:
        from torch.distributed.tensor import DTensor

        parameters = list(parameters)
        grads = [p.grad for p in parameters if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads)
        if isinstance(norm, DTensor):  # each rank holds a partial norm of its shards
            norm = norm.full_tensor()
        torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, norm)
        return float(norm)

    def weight_segments(self, model: nn.Module) -> Iterator[dict[str, Tensor]]:
        """One segment per FSDP2 unit (each decoder layer, then the root's own parameters), all-gathered in
        the compute dtype while the segment is in use, so no rank holds more than one unit unsharded."""
        units = fsdp_modules(model)
        for name, module in units[1:] + units[:1]:  # the root's embeddings and head last
            prefix = f"{name}." if name else ""
            inner = [f"{n}." for n, _ in units if n != name and (not name or n.startswith(prefix))]
            module.unshard()
            try:
                yield {prefix + n: p.detach() for n, p in module.named_parameters()
                       if not any((prefix + n).startswith(child) for child in inner)}
            finally:
                module.reshard()

    def gather_weights(self, model: nn.Module) -> dict[str, Tensor]:
        """Rank 0: the full weights on its CPU, gathered one FSDP2 unit at a time; other ranks: {}."""
        keep = self.rank == 0
        return {name: t.to("cpu", copy=True) for segment in self.weight_segments(model)
                for name, t in segment.items() if keep}

    def save_training_state(self, folder: Path, model: nn.Module,
                            optimizer: torch.optim.Optimizer) -> tuple[dict, dict[str, FileEntry]]:
        """Every rank writes its shards of the parameters and AdamW's state into ``folder`` (a DCP set:
        ``trainer.sharded_checkpoint``) and hashes them; rank 0 gets every rank's file entries."""
        from sliderl.trainer.checkpoint import rng_state
        from sliderl.trainer.sharded_checkpoint import OPTIMIZER_SHARDS, save_shards, shard_files

        groups = save_shards(folder, model, optimizer)
        mine = {f.name: hash_file(f) for f in shard_files(folder, self.rank)}
        entries = {name: entry for rank_entries in self.gather(mine) for name, entry in rank_entries.items()}
        return {OPTIMIZER_SHARDS: True, "param_groups": groups, "rank_rng": self.gather(rng_state()),
                "num_ranks": self.world_size}, entries

    def load_training_state(self, folder: Path, state: dict, model: nn.Module,
                            optimizer: torch.optim.Optimizer) -> None:
        from sliderl.trainer.sharded_checkpoint import OPTIMIZER_SHARDS, by_name, load_shards, set_full_state

        if OPTIMIZER_SHARDS in state:  # DCP reshards a set saved at any number of ranks
            load_shards(folder, model, optimizer, state["param_groups"])
            return
        names = [name for name, _ in model.named_parameters()]  # a one-rank checkpoint: full, keyed by index
        adamw, groups = by_name(state["optimizer"], names)
        masters = state["optimizer"].get("master_weights")
        set_full_state(model, optimizer, dict(zip(names, masters)) if masters else None, adamw, groups)

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier()


def host_state_bytes(model: nn.Module) -> int:
    """The host memory an offloaded rank's first optimizer step still allocates once its parameter shards are
    in place: a gradient and AdamW's two moments per local (shard) element of every trained parameter, each in
    the shard's dtype (float32 masters: 12 bytes an element)."""
    total = 0
    for p in model.parameters():
        if p.requires_grad:
            local = p.to_local() if hasattr(p, "to_local") else p
            total += 3 * local.numel() * local.element_size()
    return total


def available_host_memory() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (what the kernel can hand out without swapping), None off Linux."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_host_memory(needs: list[int], available: int | None, host: str) -> None:
    """learner.offload: cpu — refuse, with the numbers, a node whose ranks (``needs``: each one's
    ``host_state_bytes``) cannot fit their optimizer state in its host memory: the alternative is the kernel's OOM
    killer taking a rank at the end of the first step, which reads as a dead rank and restarts into the same wall.
    ``available`` None (not Linux): no check."""
    if available is None or sum(needs) <= available:
        return
    gib = 2**30
    raise ValueError(f"learner.offload=cpu: the gradients and AdamW state still to be allocated need "
                     f"{sum(needs) / gib:.1f} GiB of host memory on {host} ({len(needs)} rank(s), up to "
                     f"{max(needs) / gib:.1f} GiB each), but {available / gib:.1f} GiB is available there; split "
                     f"the state over more ranks (learner.num_ranks, on more nodes), set learner.master_weights=false "
                     f"(half the bytes), or use nodes with more memory")


def fsdp_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's FSDP2 units as (qualified name, module), the root ('') first."""
    from torch.distributed.fsdp import FSDPModule

    return [(name, m) for name, m in model.named_modules() if isinstance(m, FSDPModule)]


def _drop_fused_weights(model: nn.Module) -> None:
    """Forget the inference-only fused q/k/v and gate/up tensors (``FusedLinears``): the parameters get new,
    sharded storage, and the old fused tensors would keep a full copy of those weights alive."""
    for module in model.modules():
        for fused in (v for v in vars(module).values() if isinstance(v, FusedLinears)):
            fused.weight = fused.bias = None


def destroy_process_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


__all__ = ["FSDPParallel", "Parallel", "ProcessGroupSpec", "available_host_memory", "balanced_partition",
           "check_host_memory", "host_state_bytes", "open_rendezvous", "process_group_backend"]
