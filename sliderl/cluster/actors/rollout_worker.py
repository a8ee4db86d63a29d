"""The rollout worker: one engine, its own step loop, rewards, and whole groups into the trace queue.

``RolloutWorker`` is a plain class that ``cluster.actors.placement`` turns into a threaded Ray actor
(``max_concurrency`` >= 3), so calls arrive while it generates. Three threads share it:

- the engine thread runs the engine's ``step()`` in a loop (``rollout.backend``: the engine chosen by
  ``rollout.backend``, sliderl's ``LLM`` by default): it admits submitted groups, applies a pending
  weight update *between* engine steps, hands every finished group to the scorer, and frees or
  re-allocates the KV pool when asked while no request is unfinished (``release_memory``);
- the scorer thread computes rewards off the engine's path and puts each group, as one
  ``RolloutGroup`` (a group is atomic), into the bounded trace queue, blocking while it is full;
- actor calls (``submit``, ``update_weights``, ``status``, ``evaluate``, ``release_memory``) run on Ray's threads.

A weight update that lands while a sample is in flight is recorded on its trace
(``weight_update_token_index``: the completion index from which the new weights sampled); the
trace keeps the version its group started with, so staleness is judged conservatively.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
import traceback
import uuid
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from sliderl.cluster.actors.placement import actor_options, bundles, torch_threads, worker_bundle
from sliderl.cluster.actors.weight_sync import WeightPayload, WeightReceiver
from sliderl.cluster.config.train import TrainConfig
from sliderl.cluster.observe.dashboard import rollout_role
from sliderl.cluster.records import Problem, PromptGroup, RolloutGroup, WorkerStatus
from sliderl.cluster.storage.model_files import ModelFiles, local_folder
from sliderl.core.trace import Trace
from sliderl.rewards import RewardInput, RewardRecord, RewardSpec
from sliderl.rollout.engine_args import EngineArgs
from sliderl.rollout.restart.records import RestartRequestOutput
from sliderl.rollout.sampling import SamplingParams
from sliderl.rollout.sequence import RequestOutput

PUT_TIMEOUT_S = 1.0  # queue.put retries at this period so a stopping worker never blocks forever
IDLE_WAIT_S = 1.0
WORKER_CONCURRENCY = 4  # submit/status/update_weights/evaluate may arrive while the worker generates


@dataclass
class _InFlight:
    """One group inside the engine."""

    group: PromptGroup
    version: int
    started: float
    outputs: list = field(default_factory=list)  # RequestOutput per sample, None until finished
    update_index: list[int] = field(default_factory=list)
    seqs: list = field(default_factory=list)


@dataclass
class _EvalJob:
    prompts: list[str | list[int]]
    params: Any
    future: Future
    outputs: list = field(default_factory=list)
    remaining: int = 0


class RolloutWorker:
    """Generates groups with ``rollout.LLM`` and streams them, scored, into ``trace_queue``.

    model: the initial weights, a ``ModelFiles`` (opened on this worker's node) or a local folder.
    """

    def __init__(self, worker_id: int, model: ModelFiles | str, version: int, engine: EngineArgs, sampling: SamplingParams,
                 reward: RewardSpec, task_type: str, trace_queue, num_threads: int = 1, backend: str = "paged"):
        import os

        import torch

        from sliderl.rollout.backend import build_engine

        torch.set_num_threads(max(1, num_threads))
        self.worker_id = worker_id
        self.incarnation = uuid.uuid4().hex[:8]
        self.pid = os.getpid()
        self.llm = build_engine(backend, local_folder(model), engine)  # the calls it takes: rollout.backend.RolloutEngine
        self.version = version
        self.sampling = sampling
        self.reward = reward.build(task_type, self.llm.tokenizer)
        self.receiver = WeightReceiver(self.llm.device)
        self.trace_queue = trace_queue
        self._fenced = _restarted()  # a restarted process has stale weights: no work until it gets new ones
        self._ray_metrics = _ray_metrics(worker_id)
        self._lock = threading.Condition()
        self._inbox: list[PromptGroup] = []
        self._evals: list[_EvalJob] = []
        self._pending: tuple[int, dict, threading.Event] | None = None
        self._idle_calls: list[tuple[Any, threading.Event]] = []  # run by the engine thread once no request is unfinished
        self._inflight: dict[str, _InFlight] = {}
        self._by_request: dict[int, tuple[Any, int]] = {}  # request id -> (_InFlight | _EvalJob, index)
        self._scored: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._error: str | None = None
        self._threads = [threading.Thread(target=self._guard, args=(fn,), daemon=True, name=fn.__name__)
                         for fn in (self._engine_loop, self._scorer_loop)]
        for thread in self._threads:
            thread.start()

    # ---- actor API -----------------------------------------------------------------------------
    def submit(self, groups: list[PromptGroup]) -> int:
        """Queue groups for generation; returns how many groups this worker now holds.

        A restarted worker refuses work (returns -1; the driver re-issues it) until it has been
        given weights: its process came back with the initial ones.
        """
        with self._lock:
            if self._fenced:
                return -1
            self._inbox.extend(groups)
            self._lock.notify_all()
            return len(self._inbox) + len(self._inflight)

    def update_weights(self, version: int, payload: WeightPayload, force: bool = False) -> float:
        """Receive weights ``version`` and wait until the engine applied them between two steps.

        payload is what the learner's ``WeightSender.publish`` returned (a ``StateDictPayload``, an
        ``IpcPayload``, or a ``BroadcastNotice`` whose tensors arrive through the process group).
        Versions only grow unless ``force``. Returns the seconds from the call to the applied update.
        """
        start = time.perf_counter()
        if version < self.version and not force:
            raise ValueError(f"worker {self.worker_id}: weight version {version} is older than its version "
                             f"{self.version}; versions are monotonic")
        weights = self.receiver.receive(payload)
        done = threading.Event()
        with self._lock:
            if self._pending is not None:  # superseded before the engine got to it: the newer one wins
                self._pending[2].set()
            self._pending = (version, weights, done)
            self._lock.notify_all()
        while not done.wait(IDLE_WAIT_S):
            self._raise_if_failed()
        return time.perf_counter() - start

    def release_memory(self) -> float:
        """Free the engine's KV pool and CUDA graphs (``LLM.sleep``) as soon as no request is unfinished, so a
        learner on the same GPU can use the memory; seconds until done. The engine allocates them again
        before it next generates (``restore_memory`` does it now)."""
        return self._when_idle(self.llm.sleep)

    def restore_memory(self) -> float:
        """Allocate the KV pool and capture the CUDA graphs again after ``release_memory``; seconds until done."""
        return self._when_idle(self.llm.wake)

    def join_broadcast(self, address: str, world_size: int, rank: int, group_name: str, backend: str,
                       timeout_s: float) -> None:
        """Join the learner's broadcast process group (see ``cluster.actors.weight_sync``)."""
        self.receiver.join(address, world_size, rank, group_name, backend, timeout_s)

    def status(self) -> WorkerStatus:
        """Identity, version, held groups, and the error that stopped a thread (if any)."""
        with self._lock:
            held = [g.group_id for g in self._inbox] + list(self._inflight)
        return WorkerStatus(self.worker_id, self.incarnation, self.pid, self.version, held, self._fenced, self._error)

    def evaluate(self, prompts: list[str | list[int]], params: SamplingParams) -> list[RequestOutput]:
        """Generate one completion per prompt (text or token ids, through the same engine loop); RequestOutputs
        in order."""
        job = _EvalJob(list(prompts), params, Future())
        with self._lock:
            self._evals.append(job)
            self._lock.notify_all()
        while True:
            try:
                return job.future.result(timeout=IDLE_WAIT_S)
            except TimeoutError:
                self._raise_if_failed()

    def engine_args(self) -> EngineArgs:
        """The settings the engine was built with."""
        return self.llm.args

    def parameter(self, name: str) -> list[float]:
        """The current values of one weight (flattened), read between engine steps; for checks."""
        with self._lock:
            return self.llm.model.state_dict()[name].detach().float().flatten().tolist()

    def stop(self) -> None:
        """Stop both threads (pending work is abandoned)."""
        self._stop.set()
        with self._lock:
            self._lock.notify_all()

    # ---- engine thread -------------------------------------------------------------------------
    def _guard(self, loop) -> None:
        try:
            loop()
        except Exception:  # surfaced to the driver through status() and blocked calls
            self._error = traceback.format_exc()
            self._stop.set()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"rollout worker {self.worker_id} stopped: {self._error}")

    def _engine_loop(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                self._apply_pending()
                self._admit()
                busy = self.llm.has_unfinished()
                calls = [] if busy else self._idle_calls
                self._idle_calls = self._idle_calls if busy else []
                if not busy and not calls:
                    self._lock.wait(IDLE_WAIT_S)
                    continue
            for call, done in calls:  # outside the lock: allocating and capturing takes seconds
                call()
                done.set()
            if busy:
                if self.llm.asleep:  # work arrived while the pool was released
                    self.llm.wake()
                for seq in self.llm.step():
                    self._finished(seq)

    def _when_idle(self, call) -> float:
        """Run ``call`` on the engine thread once no request is unfinished; wait for it, return the seconds."""
        start, done = time.perf_counter(), threading.Event()
        with self._lock:
            self._idle_calls.append((call, done))
            self._lock.notify_all()
        while not done.wait(IDLE_WAIT_S):
            self._raise_if_failed()
        return time.perf_counter() - start

    def _apply_pending(self) -> None:
        if self._pending is None:
            return
        version, weights, done = self._pending
        self.llm.load_weights(weights)
        for job in self._inflight.values():
            for j, seq in enumerate(job.seqs):
                if job.outputs[j] is None and job.update_index[j] < 0:
                    job.update_index[j] = seq.num_output
        self.version, self._pending, self._fenced = version, None, False
        done.set()

    def _admit(self) -> None:
        for group in self._inbox:
            job = _InFlight(group, self.version, time.perf_counter(), [None] * group.group_size, [-1] * group.group_size)
            for j in range(group.group_size):
                seq = self.llm.add_request(group.problem.engine_prompt, self.sampling.for_sample(j, group.seed))
                job.seqs.append(seq)
                self._by_request[seq.request_id] = (job, j)
            self._inflight[group.group_id] = job
        self._inbox.clear()
        for job in self._evals:
            job.outputs, job.remaining = [None] * len(job.prompts), len(job.prompts)
            for i, prompt in enumerate(job.prompts):
                self._by_request[self.llm.add_request(prompt, job.params).request_id] = (job, i)
        self._evals.clear()

    def _finished(self, seq) -> None:
        job, index = self._by_request.pop(seq.request_id)
        output = self.llm.output(seq)
        job.outputs[index] = output
        if isinstance(job, _EvalJob):
            job.remaining -= 1
            if job.remaining == 0:
                job.future.set_result(job.outputs)
        elif all(o is not None for o in job.outputs):
            with self._lock:
                del self._inflight[job.group.group_id]
            self._scored.put(job)

    # ---- scorer thread -------------------------------------------------------------------------
    def _scorer_loop(self) -> None:
        while not self._stop.is_set():
            try:
                job = self._scored.get(timeout=IDLE_WAIT_S)
            except queue.Empty:
                continue
            group = self._score(job)
            self._record(group)
            self._put(group)

    def _score(self, job: _InFlight) -> RolloutGroup:
        traces = [self._trace(job, j, out) for j, out in enumerate(job.outputs)]
        return RolloutGroup(job.group.group_id, self.worker_id, self.incarnation, job.version, traces,
                            time.perf_counter() - job.started)

    def _trace(self, job: _InFlight, j: int, out) -> Trace:
        problem: Problem = job.group.problem
        trace_id = f"{job.group.group_id}-{j}-w{self.worker_id}.{self.incarnation}"
        record = self._reward(trace_id, out, problem)
        restarts = restarts_of(out)
        return Trace(
            trace_id=trace_id,
            group_id=job.group.group_id, prompt_id=problem.prompt_id, worker_id=self.worker_id,
            policy_version=job.version, kv_policy=self.llm.policy.spec,
            prompt_token_ids=list(out.prompt_token_ids), completion_token_ids=list(out.token_ids),
            logprobs=list(out.logprobs), finish_reason=out.finish_reason,
            temperature=float(self.sampling.temperature),
            weight_update_token_index=job.update_index[j], forced=list(out.forced),
            reward=float(record.total), reward_components=dict(record.components), answer=problem.answer,
            completion_text=out.text, num_tokens=len(out.token_ids), peak_visible_kv=out.kv.peak_visible_tokens,
            mean_visible_kv=float(out.kv.mean_visible_tokens), decode_seconds=float(out.seconds),
            kv_deaths=Trace.flat_deaths(out.kv_deaths), num_preemptions=int(out.num_preemptions),
            restarts=restarts, reencoded_tokens=sum(len(r.context_tail) for r in restarts),
            kv_token_steps=int(out.kv.token_steps), max_token_seconds=float(out.max_token_seconds),
        )

    def _reward(self, trace_id: str, out, problem: Problem) -> RewardRecord:
        """The trace's reward; a term that raises gives a NaN reward (``reward_error`` 1), which makes the
        learner skip the trace's whole group and count it (``skipped_groups_nonfinite_reward``)."""
        try:
            return self.reward.score(RewardInput(
                out.text, problem.answer, out.kv.mean_visible_tokens, prompt_token_ids=out.prompt_token_ids,
                completion_token_ids=out.token_ids, forced=out.forced, baseline_tokens=problem.baseline_tokens,
                kv_token_steps=out.kv.token_steps, num_restarts=len(restarts_of(out)),
                reencoded_tokens=sum(len(r.context_tail) for r in restarts_of(out))))
        except Exception as err:  # any term's failure: the run goes on, the group is not trained
            print(f"rollout worker {self.worker_id}: the reward failed on trace {trace_id}, its group will be "
                  f"skipped: {type(err).__name__}: {' '.join(str(err).split())}", file=sys.stderr, flush=True)
            return RewardRecord(float("nan"), {"reward_error": 1.0})

    def _record(self, group: RolloutGroup) -> None:
        if self._ray_metrics is None or not group.traces:
            return
        n = len(group.traces)
        self._ray_metrics.record(tokens_per_s=group.num_tokens / max(group.generate_seconds, 1e-9),
                             visible_kv=sum(t.mean_visible_kv for t in group.traces) / n,
                             reward=sum(t.reward for t in group.traces) / n)

    def _put(self, group: RolloutGroup) -> None:
        from ray.util.queue import Full

        while not self._stop.is_set():
            try:
                self.trace_queue.put(group, block=True, timeout=PUT_TIMEOUT_S)
                return
            except Full:
                continue


def _restarted() -> bool:
    """True in an actor process that Ray started again after the previous one died."""
    import warnings

    import ray

    with warnings.catch_warnings():  # Ray's own property trips its deprecated actor_id internally
        warnings.simplefilter("ignore", DeprecationWarning)
        return ray.is_initialized() and ray.get_runtime_context().was_current_actor_reconstructed


def _ray_metrics(worker_id: int):
    """Ray custom metrics of this worker, or None outside a Ray worker process."""
    try:
        from sliderl.cluster.observe.ray_metrics import RolloutMetrics

        return RolloutMetrics(worker_id)
    except Exception:  # metrics are best-effort: no metrics agent (e.g. outside Ray) must not stop rollouts
        return None


def make_worker(cfg: TrainConfig, pg, worker_id: int, model: ModelFiles | str, version: int, trace_queue):
    """Rollout worker ``worker_id`` in the bundle after the learner ranks'; Ray restarts it when its process dies."""
    import ray


    index = worker_bundle(cfg, worker_id)
    options = actor_options(cfg, rollout_role(worker_id), bundles(cfg)[index], pg, index)
    return ray.remote(RolloutWorker).options(
        max_restarts=cfg.rollout.max_restarts, max_task_retries=0, max_concurrency=WORKER_CONCURRENCY, **options,
    ).remote(worker_id, model, version, cfg.worker_engine_args(worker_id), cfg.sampling, cfg.reward,
             cfg.task.type, trace_queue, torch_threads(cfg.rollout.num_cpus), cfg.rollout.backend)


def restarts_of(out: RequestOutput) -> list:
    """The restarts of an output (``core.restart.Restart``; none outside ``last_k`` / ``summary``)."""
    return list(out.restarts) if isinstance(out, RestartRequestOutput) else []
