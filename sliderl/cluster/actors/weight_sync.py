"""Weight sync: the learner's new weights reach every rollout worker, versions only growing.

One interface, three backends (``weight_sync.backend``):

- ``object_store`` (default): ``publish`` returns the state dict as CPU tensors; Ray keeps it in
  the object store once and every worker fetches it. Works for any placement, CPU or GPU.
- ``cuda_ipc``: ``publish`` packs the weights into one flat CUDA buffer per dtype and returns
  ``torch.multiprocessing`` IPC handles to them; a worker on the same node maps the learner's
  memory and copies from it. The sender keeps the buffers alive until the next publish; workers
  copy before they acknowledge, so a buffer is never read after it is replaced.
- ``broadcast``: the learner (rank 0) and the workers (ranks 1..N) form a torch.distributed
  process group (``nccl`` on GPU, ``gloo`` on CPU; the rendezvous address travels through Ray)
  and the flat buffers are broadcast from rank 0, one segment at a time. The group is built from the classes directly
  (``TCPStore`` + ``ProcessGroupGloo``/``ProcessGroupNCCL``), so it never touches a default group
  the learner may use for itself. A worker that restarts cannot rejoin a live group: the driver
  rebuilds the group under a new name.

The learner hands the sender its weights in *segments* (``Learner.weight_segments``): one for a
one-process learner, one FSDP2 unit (a decoder layer, then the embeddings and head) for a sharded one,
all-gathered only while it is copied out, so no learner rank holds a second full copy of the weights
(``cuda_ipc`` excepted: rank 0 keeps the full flat buffers the workers map). Every learner rank takes
part in the gathering; only rank 0 sends.

``WeightSender`` lives in the learner actor, ``WeightReceiver`` in each rollout worker (both plain
torch); ``WeightSync`` is the driver's side, the only one here that talks to Ray.
"""

from __future__ import annotations

import datetime
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

BACKENDS = ("object_store", "cuda_ipc", "broadcast")


# ------------------------------------------------------------------------------ flat buffers


@dataclass(frozen=True)
class FlatLayout:
    """Where each tensor sits in its dtype's flat buffer: ``entries[i] = (name, shape, dtype, offset)``, and the
    ranges ``segments[j] = (dtype, start, end)`` of those buffers in the order they are sent."""

    entries: tuple[tuple[str, tuple[int, ...], str, int], ...]
    sizes: dict[str, int]  # dtype name -> numel of its buffer
    segments: tuple[tuple[str, int, int], ...] = ()

    @classmethod
    def of(cls, state_dict: dict[str, torch.Tensor]) -> FlatLayout:
        """One segment: each dtype's buffer is sent whole."""
        return cls.of_segments([state_dict])

    @classmethod
    def of_segments(cls, segments: Iterable[dict[str, torch.Tensor]]) -> FlatLayout:
        """The layout of ``segments`` (dicts of tensors by name) laid end to end; each segment's tensors of
        one dtype form one contiguous range of that dtype's buffer."""
        entries, sizes, ranges = [], {}, []
        for segment in segments:
            starts: dict[str, int] = {}
            for name, tensor in segment.items():
                dtype = str(tensor.dtype).removeprefix("torch.")
                starts.setdefault(dtype, sizes.get(dtype, 0))
                entries.append((name, tuple(tensor.shape), dtype, sizes.get(dtype, 0)))
                sizes[dtype] = sizes.get(dtype, 0) + tensor.numel()
            ranges += [(dtype, start, sizes[dtype]) for dtype, start in starts.items()]
        return cls(tuple(entries), sizes, tuple(ranges))

    def empty(self, device: torch.device | str) -> dict[str, torch.Tensor]:
        """Uninitialised buffers to receive into."""
        return {d: torch.empty(n, dtype=getattr(torch, d), device=device) for d, n in self.sizes.items()}


def flatten(state_dict: dict[str, torch.Tensor], layout: FlatLayout, device) -> dict[str, torch.Tensor]:
    """The tensors of ``state_dict`` copied into one flat buffer per dtype on ``device``."""
    buffers = layout.empty(device)
    for name, shape, dtype, offset in layout.entries:
        tensor = state_dict[name]
        buffers[dtype][offset:offset + tensor.numel()].copy_(tensor.detach().reshape(-1))
    return buffers


def flatten_segment(segment: dict[str, torch.Tensor], device) -> dict[str, torch.Tensor]:
    """One segment's tensors copied into one flat buffer per dtype (in order of first appearance) on ``device``."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in segment.values():
        by_dtype.setdefault(tensor.dtype, []).append(tensor)
    buffers = {}
    for dtype, tensors in by_dtype.items():
        buffer = torch.empty(sum(t.numel() for t in tensors), dtype=dtype, device=device)
        offset = 0
        for t in tensors:
            buffer[offset:offset + t.numel()].copy_(t.detach().reshape(-1))
            offset += t.numel()
        buffers[str(dtype).removeprefix("torch.")] = buffer
    return buffers


def unflatten(buffers: dict[str, torch.Tensor], layout: FlatLayout) -> dict[str, torch.Tensor]:
    """Views of the flat buffers, one per tensor name, with their shapes."""
    out = {}
    for name, shape, dtype, offset in layout.entries:
        numel = 1
        for size in shape:
            numel *= size
        out[name] = buffers[dtype][offset:offset + numel].view(shape)
    return out


# ------------------------------------------------------------------------ payload records


@dataclass(frozen=True)
class StateDictPayload:
    """The weights themselves, as CPU tensors by HF name (``object_store``: Ray holds them once for every worker)."""

    tensors: dict[str, torch.Tensor]


@dataclass(frozen=True)
class IpcPayload:
    """CUDA IPC handles of the flat buffers, and the GPU (by UUID) that holds them."""

    layout: FlatLayout
    device_uuid: str
    handles: dict[str, tuple]  # dtype -> (rebuild function, args) from reduce_tensor


@dataclass(frozen=True)
class BroadcastNotice:
    """Tells a receiver to take the next broadcast from rank 0, laid out as ``layout``."""

    version: int
    layout: FlatLayout


WeightPayload = StateDictPayload | IpcPayload | BroadcastNotice
"""What the learner's ``publish`` hands the workers' ``update_weights``, one kind per backend."""


# ----------------------------------------------------------------------------- the two ends


class _BroadcastGroup:
    """A process group of the learner (rank 0) and the workers, built without a default group."""

    def __init__(self, address: str, world_size: int, rank: int, name: str, backend: str, timeout_s: float,
                 device: torch.device, store=None):
        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=timeout_s)
        host, port = address.rsplit(":", 1)
        if store is None:
            store = dist.TCPStore(host, int(port), world_size, False, timeout=timeout)
        prefixed = dist.PrefixStore(name, store)
        self.backend, self.rank, self.device = backend, rank, device
        if backend == "nccl":
            if device.index is None:  # "cuda": the actor's own GPU (Ray sets CUDA_VISIBLE_DEVICES)
                device = torch.device("cuda", torch.cuda.current_device())
                self.device = device
            torch.cuda.set_device(device)
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.pg = dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
        else:
            self.pg = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)

    def broadcast(self, tensor: torch.Tensor) -> None:
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.pg.broadcast([tensor], opts).wait()


def buffer_device(backend: str, device: torch.device) -> torch.device:
    """gloo moves CPU tensors; nccl the tensors of the process's GPU."""
    return device if backend == "nccl" else torch.device("cpu")


class WeightSender:
    """The learner's end: ``publish(version, state_dict)`` returns what the workers need."""

    def __init__(self, backend: str, device: torch.device | str = "cpu"):
        if backend not in BACKENDS:
            raise ValueError(f"unknown weight sync backend {backend!r}; valid: {', '.join(BACKENDS)}")
        self.backend = backend
        self.device = torch.device(device)
        self._kept: dict[str, torch.Tensor] | None = None  # cuda_ipc buffers the workers map
        self._group: _BroadcastGroup | None = None
        self._store = None
        self.layout: FlatLayout | None = None

    def publish(self, version: int, segments: Iterable[dict[str, torch.Tensor]] | dict[str, torch.Tensor],
                sends: bool = True) -> WeightPayload | None:
        """The weights by HF name, as one dict or as segments (``Learner.weight_segments``). object_store: a
        ``StateDictPayload`` of CPU tensors; cuda_ipc: an ``IpcPayload``; broadcast: broadcasts each segment's
        buffers to the group (blocking until every rank took them) and returns the notice. ``sends=False``
        (a sharded learner's rank other than 0): only go through the segments (their gathering is a
        collective), and return None."""
        segments = [segments] if isinstance(segments, dict) else segments
        if not sends:
            for _ in segments:
                pass
            return None
        if self.backend == "object_store":
            return StateDictPayload({name: t.detach().to("cpu", copy=True) for segment in segments
                                     for name, t in segment.items()})
        if self.backend == "cuda_ipc":
            return self._ipc(segments)
        if self._group is None:
            raise RuntimeError("broadcast weight sync: the learner has not joined a process group")
        specs = []
        for segment in segments:
            for buffer in flatten_segment(segment, buffer_device(self._group.backend, self.device)).values():
                self._group.broadcast(buffer)
            specs.append({name: torch.empty(t.shape, dtype=t.dtype, device="meta") for name, t in segment.items()})
        self.layout = self.layout or FlatLayout.of_segments(specs)
        return BroadcastNotice(version, self.layout)

    def _ipc(self, segments: Iterable[dict[str, torch.Tensor]]) -> IpcPayload:
        from torch.multiprocessing.reductions import reduce_tensor

        if self.device.type != "cuda":
            raise RuntimeError("cuda_ipc weight sync needs the learner on a CUDA device")
        pieces: dict[str, list[torch.Tensor]] = {}
        specs = []
        for segment in segments:
            for dtype, buffer in flatten_segment(segment, self.device).items():
                pieces.setdefault(dtype, []).append(buffer)
            specs.append({name: torch.empty(t.shape, dtype=t.dtype, device="meta") for name, t in segment.items()})
        self.layout = self.layout or FlatLayout.of_segments(specs)
        self._kept = {d: p[0] if len(p) == 1 else torch.cat(p) for d, p in pieces.items()}
        torch.cuda.synchronize(self.device)
        uuid = str(torch.cuda.get_device_properties(self.device).uuid)
        return IpcPayload(self.layout, uuid, {d: reduce_tensor(b) for d, b in self._kept.items()})

    def open_rendezvous(self, host: str) -> str:
        """Start the rendezvous store on a free port of ``host``; returns ``host:port``."""
        import torch.distributed as dist

        self._store = dist.TCPStore(host, 0, None, True, timeout=datetime.timedelta(seconds=300),
                                    wait_for_workers=False)
        return f"{host}:{self._store.port}"

    def join(self, address: str, world_size: int, name: str, backend: str, timeout_s: float) -> None:
        """Become rank 0 of the group ``name`` (the workers join at the same time)."""
        self._group = _BroadcastGroup(address, world_size, 0, name, backend, timeout_s, self.device, store=self._store)


class WeightReceiver:
    """A worker's end: ``receive(payload)`` -> ``{name: tensor}`` ready for ``LLM.load_weights``."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self._group: _BroadcastGroup | None = None

    def receive(self, payload: WeightPayload) -> dict[str, torch.Tensor]:
        if isinstance(payload, StateDictPayload):
            return payload.tensors
        if isinstance(payload, IpcPayload):
            return self._from_ipc(payload)
        if isinstance(payload, BroadcastNotice):
            return self._from_broadcast(payload)
        raise TypeError(f"unknown weight payload {type(payload).__name__}; expected a StateDictPayload, "
                        "IpcPayload or BroadcastNotice")

    def _from_ipc(self, payload: IpcPayload) -> dict[str, torch.Tensor]:
        index = local_cuda_index(payload.device_uuid)
        buffers = {}
        for dtype, (rebuild, args) in payload.handles.items():
            args = list(args)
            args[6] = index  # storage_device: the sender's GPU as this process numbers it
            buffers[dtype] = rebuild(*args)
        # copied here: the sender may replace its buffers after the next publish
        return {name: t.clone() for name, t in unflatten(buffers, payload.layout).items()}

    def _from_broadcast(self, notice: BroadcastNotice) -> dict[str, torch.Tensor]:
        if self._group is None:
            raise RuntimeError("broadcast weight sync: this worker has not joined the process group")
        buffers = notice.layout.empty(buffer_device(self._group.backend, self.device))
        for dtype, start, end in notice.layout.segments:
            self._group.broadcast(buffers[dtype][start:end])
        return unflatten(buffers, notice.layout)

    def join(self, address: str, world_size: int, rank: int, name: str, backend: str, timeout_s: float) -> None:
        self._group = _BroadcastGroup(address, world_size, rank, name, backend, timeout_s, self.device)


def local_cuda_index(device_uuid: str) -> int:
    """This process's index of the GPU with ``device_uuid``; a clear error when it is not visible."""
    for i in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(i).uuid) == device_uuid:
            return i
    raise RuntimeError(f"cuda_ipc weight sync: the learner's GPU {device_uuid} is not visible to this worker "
                       "(CUDA_VISIBLE_DEVICES); share a GPU between learner and workers (fractional num_gpus) "
                       "or use weight_sync.backend=broadcast")


def resolve_broadcast_backend(choice: str, learner_device: str) -> str:
    """auto -> nccl when the learner is on CUDA, else gloo."""
    if choice != "auto":
        return choice
    return "nccl" if learner_device.startswith("cuda") else "gloo"


# ------------------------------------------------------------------------- the driver's side


@dataclass
class SyncReport:
    """One publish: the version, its wall seconds, and the workers that failed to take it."""

    version: int
    seconds: float
    failed: list[int]


class WeightSync:
    """Moves the learner's weights to the workers; the driver calls it between learner steps."""

    def __init__(self, backend: str, broadcast_backend: str, learner_device: str, timeout_s: float):
        self.backend = backend
        self.group_backend = resolve_broadcast_backend(broadcast_backend, learner_device)
        self.timeout_s = timeout_s
        self._generation = 0
        self._members: tuple[int, ...] | None = None  # worker ids in the current broadcast group
        self._layout: FlatLayout | None = None
        self.last_payload = None  # object_store: the ref of the last published state dict

    def publish(self, version: int, learner, workers: dict[int, Any]) -> SyncReport:
        """Send the learner's weights (version ``version``) to every worker in ``workers``.

        A worker that fails to take them (dead, restarting, or out of a broadcast group) is listed
        in the report; the driver's health check recovers it. A failed broadcast also rebuilds
        the group at the next publish.
        """
        start = time.perf_counter()
        if self.backend == "broadcast":
            self._ensure_group(learner, workers)
            sent = learner.publish_weights.remote(version)
            notice = BroadcastNotice(version, self._layout)
            failed = self._wait({wid: w.update_weights.remote(version, notice) for wid, w in workers.items()})
            failed += self._wait({-1: sent})
            if failed:
                self._members = None
        else:
            payload = learner.publish_weights.remote(version)
            self.last_payload = payload if self.backend == "object_store" else None
            failed = self._wait({wid: w.update_weights.remote(version, payload) for wid, w in workers.items()})
        return SyncReport(version, time.perf_counter() - start, [wid for wid in failed if wid >= 0])

    def catch_up(self, version: int, worker) -> bool:
        """Give one (restarted) worker the last published weights now; False when only a full
        publish can (cuda_ipc/broadcast: the driver then publishes again to everyone)."""
        if self.backend != "object_store" or self.last_payload is None:
            self._members = None
            return False
        import ray
        from ray.exceptions import GetTimeoutError, RayError

        try:
            ray.get(worker.update_weights.remote(version, self.last_payload, True), timeout=self.timeout_s)
        except (RayError, GetTimeoutError):  # down again: the next health check sees it
            return False
        return True

    def _wait(self, refs: dict[int, Any]) -> list[int]:
        """Ids whose call failed or did not finish within the timeout."""
        import ray
        from ray.exceptions import GetTimeoutError, RayError

        failed = []
        for wid, ref in refs.items():
            try:
                ray.get(ref, timeout=self.timeout_s)
            except (RayError, GetTimeoutError) as err:
                failed.append(wid)
                print(f"sliderl: weight sync to {'the learner' if wid < 0 else f'worker {wid}'} failed: "
                      f"{' '.join(str(err).split())[:300]}", file=sys.stderr)
        return failed

    def _ensure_group(self, learner, workers: dict[int, Any]) -> None:
        import ray

        members = tuple(sorted(workers))
        if self._members == members:
            return
        self._generation += 1
        name = f"sliderl-weights-{self._generation}"
        address = ray.get(learner.open_rendezvous.remote(), timeout=self.timeout_s)
        world = len(members) + 1
        refs = [learner.join_broadcast.remote(address, world, name, self.group_backend, self.timeout_s)]
        refs += [workers[wid].join_broadcast.remote(address, world, rank + 1, name, self.group_backend, self.timeout_s)
                 for rank, wid in enumerate(members)]
        ray.get(refs, timeout=self.timeout_s)
        self._layout = ray.get(learner.weight_layout.remote(), timeout=self.timeout_s)
        self._members = members
