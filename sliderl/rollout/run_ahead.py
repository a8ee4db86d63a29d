"""Overlap: the next decode step is queued on the device before this step's tokens are read back.

The host's bookkeeping of step t (postprocessing, the next schedule) then runs while the device
computes step t + 1, whose input tokens are copied from step t's samples on the device. The queued
step is asked of the scheduler (``Scheduler.schedule_ahead``), which allocates it only when it is
certain to be needed as launched. Everything that follows from running ahead lives here:

- a queued row whose sequence finished meanwhile is wasted work for that row only: it is dropped;
- under ``registers``, a row whose input token (sampled, not yet read) is a register that kills a step must
  not see that step's keys, which the cache's deaths show only once the host has read the token: the queued
  forward masks that step itself (``kernels.metadata.register_kills``, from the host's register ranges);
- a queued step whose inputs would be wrong (new weights) is dropped before it is used, and its
  K/V writes are redone by the step that replaces it;
- under pasta, what a tag does is known once its token is read: a fork created, a fork ended, a
  ``<sync/>`` that joins forks, a main thread stopped each change the request's threads, and until a
  step schedules the change no step of that request is queued ahead. The one step queued before the
  change was known stays valid (it writes the tag at its slot), but for a joining ``<sync/>``, which
  moves after the joined forks' blocks, and a stopped main thread, which samples no more while its forks
  run on: those rows are dropped (a block allocated ahead for the ``<sync/>`` is freed at the join).
  A fork thus starts, and a join happens, one step later than without overlap;
- under h2o, a step's attention mass reaches its sequences only after the next step was allocated,
  so evictions use mass one step older than without overlap (``rollout.heavy_hitters``); a dropped
  step adds no mass (the step that replaces it does).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from sliderl.rollout.model_runner import ModelRunner, PageMass
from sliderl.rollout.scheduler import ScheduledBatch, Scheduler
from sliderl.rollout.sequence import Sequence, Status


@dataclass
class Flight:
    """A launched forward: its batch, the rows that sample, their logits (still being computed)."""

    batch: ScheduledBatch
    rows: list[int]
    logits: torch.Tensor
    mass: PageMass | None = None  # h2o: the forward's attention mass per block-table column

    def sampling_seqs(self) -> list[Sequence]:
        return [self.batch.seqs[i] for i in self.rows]

    def mass_values(self) -> list[torch.Tensor]:
        """The mass tensor to read back with the sampled tokens (none without h2o)."""
        return [] if self.mass is None else [self.mass.values]

    def add_mass(self, values: np.ndarray | None = None) -> None:
        """h2o: add the read-back mass (``[S, M]``) to each running sequence's pages."""
        if values is None:
            return
        for i, seq in enumerate(self.batch.seqs):
            if seq.status is Status.RUNNING:
                seq.heavy.add(self.mass.pages[i], values[i], self.mass.ends[i])

    def without_finished(self, host_tensor) -> Flight | None:
        """This queued decode step minus the sequences that finished meanwhile and the rows that went stale
        (``Sequence.stale_ahead``); None if none is left."""
        keep = [i for i in self.rows
                if self.batch.seqs[i].status is Status.RUNNING and not self.batch.seqs[i].stale_ahead()]
        if len(keep) == len(self.rows):
            return self
        if not keep:
            return None
        batch = ScheduledBatch([self.batch.seqs[i] for i in keep], [self.batch.num_tokens[i] for i in keep])
        index = host_tensor(keep, torch.long).to(self.logits.device, non_blocking=True)
        mass = self.mass.take(keep, index) if self.mass is not None else None
        return Flight(batch, list(range(len(keep))), self.logits[index], mass=mass)


class RunAhead:
    """Launches forwards and holds the one decode step queued ahead (``enabled``: queue at all)."""

    def __init__(self, runner: ModelRunner, scheduler: Scheduler, enabled: bool):
        self.runner = runner
        self.scheduler = scheduler
        self.enabled = enabled
        self.queued: Flight | None = None
        self.num_queued = 0  # decode steps launched before the previous step's tokens were read

    def launch(self, batch: ScheduledBatch) -> Flight:
        """Run a freshly scheduled batch; its sampling rows' logits."""
        rows = batch.sampling_rows()
        logits, mass = self.runner.run(batch, rows)
        return Flight(batch, rows, logits, mass=mass)

    def take(self) -> Flight | None:
        """The step queued by the previous one, ready to sample, rows that finished meanwhile dropped; None when
        nothing is queued."""
        flight, self.queued = self.queued, None
        if flight is not None:
            flight = flight.without_finished(self.runner.host_tensor)
        return flight

    def queue_next(self, flight: Flight, tokens: torch.Tensor) -> None:
        """Launch the next decode step of ``flight``'s sequences now, its inputs being ``tokens`` (on the
        device), when the scheduler allows it."""
        if not self.enabled:
            return
        nxt = self.scheduler.schedule_ahead(flight.batch)
        if nxt is None:
            return
        self.num_queued += 1
        rows = list(range(len(nxt)))
        if len(nxt) < len(flight.batch):  # rows that ended with ``flight`` (a Pasta fork's last KV) go
            going = {id(seq) for seq in nxt.seqs}
            keep = [i for i, seq in enumerate(flight.batch.seqs) if id(seq) in going]
            tokens = tokens[self.runner.host_tensor(keep, torch.long).to(tokens.device, non_blocking=True)]
        logits, mass = self.runner.run(nxt, rows, input_ids=tokens)
        self.queued = Flight(nxt, rows, logits, mass=mass)

    def drop(self) -> None:
        """Forget the queued step (its inputs are stale); its sequences are scheduled afresh."""
        self.queued = None

    def read_back(self, tokens: torch.Tensor, logprobs: torch.Tensor,
                  *arrays: torch.Tensor) -> Callable[[], list]:
        """Start copying the step's outputs to the host; the returned function waits for them and gives
        ``tokens`` and ``logprobs`` as lists, ``arrays`` (h2o's mass) as numpy arrays.

        ``tensor.tolist()`` would wait for everything queued on the stream, the next step included.
        """
        if self.runner.device.type != "cuda":
            return lambda: [tokens.tolist(), logprobs.tolist(), *(a.numpy().copy() for a in arrays)]
        host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in (tokens, logprobs, *arrays)]
        for h, t in zip(host, (tokens, logprobs, *arrays)):
            h.copy_(t, non_blocking=True)
        done = torch.cuda.Event()
        done.record()

        def wait() -> list:
            done.synchronize()
            return [host[0].tolist(), host[1].tolist(), *(h.numpy() for h in host[2:])]
        return wait
