"""The driver: prepares a run, starts its actors, runs the training loop, and cleans up.

``train(cfg)`` is ``sliderl train``. Before any actor starts it checks everything a user can get
wrong (config, dataset fields, initial model, cluster address, resources). Then a ``Session``
owns one set of actors (learner, rollout workers, trace queue) and runs the loop:

- sync:  deal the step's groups -> wait for all of them -> train -> publish weights (with
  ``rollout.release_between_steps`` the workers free their KV pools for the learner step and
  allocate them again after the publish: learner and engines colocated on one GPU);
- async: workers stay topped up with ``max_inflight_groups`` groups and generate while the learner
  trains; a step takes the first ``groups_per_step`` ready groups that are at most
  ``max_staleness`` versions old and drops the others (counted, never trained).

The initial model reaches every actor as ``ModelFiles`` (through the object store when the cluster
has several nodes), after the warm start has run on its own actor. Checkpoints, the driver state and
the trace log live under the run's storage root (``run_dir``: a local folder or a URI such as
``s3://bucket/run``), so a fresh driver on any node resumes from the root alone.

Every group that leaves the queue goes to the Parquet trace log, written as one part per checkpoint (or
per ``trace_log.PART_ROWS`` traces) and when a session ends, so the log holds every group a checkpoint
resolved. A rollout worker that dies is restarted by Ray, given the current weights, and its groups are
re-issued; the books
(``GroupLedger``) guarantee no group is trained twice. A learner that dies is recreated from the
latest checkpoint (``train.max_learner_restarts`` times); a run that cannot continue raises
``RunError`` with its checkpoints and traces intact.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path, PurePath

from sliderl.cluster.actors.baseline import baseline_lengths
from sliderl.cluster.actors.learner_group import make_learner
from sliderl.cluster.actors.placement import check_resources, cluster_capacity, connect, make_queue, release, reserve
from sliderl.cluster.actors.weight_sync import WeightSync
from sliderl.cluster.config.train import TrainConfig
from sliderl.cluster.errors import RunError, actor_death
from sliderl.cluster.eval.evaluation import score
from sliderl.cluster.observe.dashboard import job_metadata, warn_if_submitted_without_metadata
from sliderl.cluster.observe.monitor import EVAL_DIR, METRICS_FILE
from sliderl.cluster.records import EvalResult, PromptGroup, RolloutGroup, StepReport
from sliderl.cluster.run import interrupt
from sliderl.cluster.run.checkpoints import Checkpoints, DriverState
from sliderl.cluster.run.guards import StaleStreak, failed_save, stale_streak_limit, stale_streak_message
from sliderl.cluster.run.ledger import GroupLedger
from sliderl.cluster.run.plan import RunPlan, prepare
from sliderl.cluster.run.resume import roll_back
from sliderl.cluster.run.worker_pool import Health, WorkerPool
from sliderl.cluster.storage.data import PromptStream
from sliderl.cluster.storage.model_files import ModelFiles
from sliderl.trainer.metrics import StepMetrics

SKIP_REASONS = ("zero_variance_groups", "no_pair_groups", "skipped_groups_nonfinite_reward")  # algorithm counts


class LearnerLost(RuntimeError):
    """The learner actor died; the run continues from the latest checkpoint when it can."""


@dataclass
class RunResult:
    """How a run ended."""

    run_dir: Path | str  # the storage root: a Path when local, else its URI
    state: DriverState
    eval_before: EvalResult | None
    eval_after: EvalResult | None
    summary: str
    stopped_early: bool = False
    optimizer_steps: int = 0  # optimizer steps of the run, every session's (its learner's version; 0: none)
    skipped_groups: dict[str, float] = field(default_factory=dict)  # why groups gave no signal, summed over steps

    def nothing_trained(self) -> str | None:
        """Why the run took no optimizer step, or None when it took one (or was stopped early)."""
        if self.stopped_early or self.optimizer_steps > 0 or self.state.step == 0:
            return None
        reasons = ", ".join(f"{k}={v:g}" for k, v in self.skipped_groups.items() if v) or "no loss token"
        return (f"no optimizer step was taken in {self.state.step} steps: every group was skipped ({reasons}); "
                "the reward gives no signal (check the reward terms and the task)")


StepHook = Callable[["Session", int, StepReport], "bool | None"]


def train(cfg: TrainConfig, on_step: StepHook | None = None, config_path: str | None = None,
          plan: RunPlan | None = None) -> RunResult:
    """Run the job ``cfg`` to ``train.steps`` (or until ``on_step`` returns False).

    ``on_step(session, step, report)`` is called after every step; returning False ends the run
    there, without a final checkpoint (as an interruption would). An existing ``ray.init`` in this
    process is used as it is; otherwise Ray is started (or joined), with the run's job metadata
    (``config_path``: the config file it came from, for that metadata), and shut down at the end.
    ``plan``: ``prepare(cfg)`` when the caller ran it already (the CLI does, to report every user error first).
    """
    import ray

    plan = prepare(cfg) if plan is None else plan
    if (note := cfg.stale_drop_warning()) is not None:
        print(f"sliderl: warning: {note}", file=sys.stderr, flush=True)
    pg, owns_ray = None, False
    try:
        warn_if_submitted_without_metadata()
        owns_ray = connect(cfg, job_metadata(cfg, config_path))
        total, nodes = cluster_capacity()
        check_resources(cfg, total, nodes)
        model = initial_model(cfg, plan, multi_node=len(nodes) > 1)
        if plan.baseline_model is not None:  # reward.speedup: Baseline-SFT's length of every training prompt
            plan = replace(plan, train_problems=baseline_lengths(cfg, plan, multi_node=len(nodes) > 1))
        pg = reserve(cfg)
        return _sessions(cfg, plan, model, pg, on_step)
    finally:
        if pg is not None:
            release(pg)
        plan.finish()
        if owns_ray:
            ray.shutdown()


def initial_model(cfg: TrainConfig, plan: RunPlan, multi_node: bool) -> ModelFiles:
    """The model the run's actors start from, as every node opens it: the configured one, warm-started on the
    stage's own actor when enabled (trained now unless cached)."""
    from sliderl.cluster.actors.warm_start import warm_start

    model = ModelFiles.ship(plan.model_path, multi_node)
    return warm_start(cfg, model, plan.warm_start, multi_node) if plan.warm_start is not None else model


def _sessions(cfg: TrainConfig, plan: RunPlan, model: ModelFiles, pg, on_step: StepHook | None) -> RunResult:
    """Run sessions until one finishes; a lost learner resumes from the latest checkpoint."""
    restarts = 0
    while True:
        session = Session(cfg, plan, model, pg, on_step, learner_restarts=restarts)
        try:
            return session.run()
        except LearnerLost as err:
            latest = Checkpoints(plan.storage, cfg.checkpoint.keep).latest()
            if latest is None or restarts >= cfg.train.max_learner_restarts:
                why = "no intact checkpoint exists" if latest is None else "its restarts are used up"
                raise RunError(f"the learner died ({err}) and {why}; checkpoints and traces are in "
                               f"{plan.run_dir}") from None
            restarts += 1
            print(f"sliderl: the learner died ({err}); resuming from {plan.storage.uri(latest[0])}", flush=True)
            plan = replace(plan, resume=latest)
        finally:
            session.close()


class Session:
    """One set of actors and the loop that drives them."""

    def __init__(self, cfg: TrainConfig, plan: RunPlan, model: ModelFiles, pg, on_step: StepHook | None,
                 learner_restarts: int = 0):
        from sliderl.cluster.storage.trace_log import TraceLog

        self.cfg, self.plan, self.on_step = cfg, plan, on_step
        self.state = plan.resume[1] if plan.resume else DriverState()
        self.state.learner_restarts = learner_restarts
        self.ledger = GroupLedger(self.state.ledger)
        self.stream = PromptStream(plan.train_problems, cfg.rollout.group_size, cfg.train.seed,
                                   cfg.data.shuffle, cursor=self.state.cursor)
        self.backlog: list[PromptGroup] = [self.stream.group(n) for n in self.state.outstanding]
        self.trace_log = TraceLog(plan.storage)
        if plan.resume is not None:  # the records hold exactly the groups and steps of the checkpoint
            roll_back(plan.resume, self.trace_log, plan.local_dir / METRICS_FILE)
        self.checkpoints = Checkpoints(plan.storage, cfg.checkpoint.keep)
        self.monitor = None
        self.queue = make_queue(cfg)
        checkpoint = plan.storage.uri(plan.resume[0]) if plan.resume else None
        self.learner = make_learner(cfg, pg, model, checkpoint)
        self.pool = WorkerPool(cfg, pg, model, 0, self.queue)
        self.weight_sync = WeightSync(cfg.weight_sync.backend, cfg.weight_sync.broadcast_backend,
                                      cfg.learner.device, cfg.weight_sync.timeout_s)
        self.awaiting_weights: set[int] = set()
        self._step_counters = _Counters()
        self._skipped: dict[str, float] = {}
        self._learner_busy = False
        self.eval_before: EvalResult | None = None
        self._unlogged_eval_before: EvalResult | None = None  # goes into the next step's report
        self.eval_after: EvalResult | None = None
        self._warned_preemption = False
        r = cfg.rollout
        in_flight = r.num_workers * r.max_inflight_groups
        self._stale_streak = StaleStreak(stale_streak_limit(cfg.train.max_stale_streak, in_flight, r.queue_size,
                                                            cfg.train.groups_per_step))
        self._step_seconds: list[float] = []

    # ---- the run -------------------------------------------------------------------------------
    def run(self) -> RunResult:
        from sliderl.cluster.observe.monitor import Monitor

        self.pool.start(self.cfg.ray.placement_timeout_s + 600)
        self.state.version = self._learner_call(self.learner.version.remote())
        self.monitor = Monitor(self.plan.local_dir, self.cfg.monitor, self.cfg.train.steps,
                               config_dict=self.cfg.model_dump(mode="json"), kv_policy=self.cfg.engine.kv,
                               storage_root=None if self.plan.storage.local else self.plan.storage.location)
        if self.plan.resume is not None:
            self._publish()  # workers start from the initial model: give them the checkpoint's weights
        if self.cfg.eval.before and self.state.step == 0:
            self.eval_before = self._unlogged_eval_before = self._evaluate("before")
        stopped = False
        while self.state.step < self.cfg.train.steps and not stopped:
            interrupt.check()
            report = self._step()
            stopped = self.on_step is not None and self.on_step(self, self.state.step, report) is False
        if not stopped and not self.checkpoints.is_complete(self.state.step):
            self._checkpoint()
        self.trace_log.flush()
        self.checkpoints.write_state(self._snapshot())
        summary = self.monitor.finish()
        return RunResult(self.plan.run_dir, self._snapshot(), self.eval_before, self.eval_after, summary, stopped,
                         self.state.version, dict(self._skipped))

    def close(self) -> None:
        """Stop every actor of this session (the placement group stays for the next one)."""
        import ray

        if self.monitor is not None:
            self.monitor.finish(exit_code=1)
        try:
            self.trace_log.flush()  # what arrived stays on disk whatever ended the session
        except Exception as err:  # a closing session must still stop its actors
            print(f"sliderl: warning: {self.trace_log.pending} traces could not be written: {err}", file=sys.stderr,
                  flush=True)
        self.pool.stop()
        self.learner.kill()  # every rank
        try:
            ray.kill(self.queue.actor, no_restart=True)
        except Exception:  # already gone
            pass

    # ---- one step ------------------------------------------------------------------------------
    def _step(self) -> StepReport:
        n = self.cfg.train.groups_per_step
        batch = self._collect(n)
        trained_at = self.state.version
        release = self.cfg.rollout.release_between_steps
        release_seconds = self.pool.release_memory() if release else None
        metrics = self._train(batch)
        self._step_seconds.append(metrics.step_seconds)
        self.state.version = metrics.version
        for key in SKIP_REASONS:
            self._skipped[key] = self._skipped.get(key, 0.0) + metrics.algorithm.get(key, 0.0)
        self.ledger.mark_trained(batch)
        self.state.step += 1
        sync_seconds = None
        due = self.state.step % self.cfg.train.sync_every == 0 or self.state.step == self.cfg.train.steps
        if due and self.state.version != self.state.published_version:  # a step without signal changes nothing
            sync_seconds = self._publish()
        if release:  # the learner's cached memory first, so the pools fit again
            self._learner_call(self.learner.release_memory.remote())
            release_seconds += self.pool.restore_memory()
        last = self.state.step == self.cfg.train.steps
        if last or (self.cfg.checkpoint.every and self.state.step % self.cfg.checkpoint.every == 0):
            self._checkpoint()
        if last and self.cfg.eval.after:
            self.eval_after = self._evaluate("after")
        report = self._report(batch, trained_at, sync_seconds, metrics, release_seconds)
        self.monitor.log(self.state.step, report.as_dict())
        if report.preempted_traces > 0 and not self._warned_preemption:  # once a run: metrics.jsonl has every step's
            self._warned_preemption = True
            print(f"sliderl: warning: step {self.state.step}: {report.preempted_traces:.0%} of the trained traces were "
                  f"preempted and recomputed: the KV pool ({self._pool_size()}) holds less than the sequences in flight "
                  f"need (engine.kv={self.cfg.engine.kv}, {self.cfg.rollout.max_inflight_groups} groups of "
                  f"{self.cfg.rollout.group_size} in flight per worker); raise engine.kv_cache_gb (or engine.num_blocks) "
                  "or lower rollout.max_inflight_groups / engine.max_num_seqs (metric preempted_traces)",
                  file=sys.stderr, flush=True)
        self.learner.record.remote(staleness=report.staleness_mean, weight_sync_seconds=sync_seconds,
                                   queue_depth=report.queue_depth, reward=report.reward)
        return report

    def _pool_size(self) -> str:
        engine = self.cfg.engine
        if engine.num_blocks is not None:
            return f"engine.num_blocks={engine.num_blocks} of {engine.block_size} tokens"
        return f"engine.kv_cache_gb={engine.kv_cache_gb}" if engine.kv_cache_gb is not None else "engine.kv_cache_gb=null: sized from free memory"

    def _collect(self, n: int) -> list:
        """``n`` groups fit to train at the current version, dealing and waiting as needed."""
        max_staleness = self.cfg.train.staleness_limit
        batch: list = []
        deadline = time.monotonic() + self.cfg.train.group_timeout_s
        while True:
            interrupt.check()
            take = self.ledger.take(n - len(batch), self.state.version, max_staleness)
            batch += take.groups
            self._step_counters.stale += len(take.stale)
            if self._stale_streak.observe(len(take.groups), [g.policy_version for g in take.stale]):
                raise RunError(self._stale_streak_message())
            if len(batch) >= n:
                return batch
            self._feed(n - len(batch))
            if self._pump(self.cfg.train.health_check_s, limit=n - len(batch)):
                deadline = time.monotonic() + self.cfg.train.group_timeout_s
            elif time.monotonic() > deadline:
                raise RunError(f"no rollout group arrived for {self.cfg.train.group_timeout_s:g} s "
                               f"(live workers: {sorted(self.pool.live())}); see the worker logs")

    def _stale_streak_message(self) -> str:
        r = self.cfg.rollout
        in_flight = (f"{sum(self.ledger.held_by(w) for w in self.pool.live())} groups ({r.num_workers} workers x "
                     f"rollout.max_inflight_groups={r.max_inflight_groups})")
        mean = sum(self._step_seconds) / len(self._step_seconds) if self._step_seconds else None
        return stale_streak_message(self._stale_streak, self.state.version, self.cfg.train.staleness_limit,
                                    in_flight, mean)

    def _train(self, batch: list) -> dict:
        """One learner step; in async mode the queue keeps being drained for the next step meanwhile."""
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        ref = self.learner.step.remote([g.traces for g in batch])
        prefetch = self.cfg.train.mode == "async" and self.state.step + 1 < self.cfg.train.steps
        self._learner_busy = True
        try:
            while not ray.wait([ref], timeout=0)[0]:
                interrupt.check()
                room = self.cfg.train.groups_per_step - len(self.ledger.ready)
                if prefetch and room > 0:
                    self._feed(0)
                    self._pump(0.2, limit=room)
                else:
                    self._handle(self.pool.check())
                    ray.wait([ref], timeout=self.cfg.train.health_check_s)
            return ray.get(ref)
        except RayActorError as err:
            raise LearnerLost(actor_death(err)) from None
        except RayTaskError as err:  # the step raised (a non-finite loss or gradient, a bad trace): not retried
            cause = err.cause if err.cause is not None else err
            raise RunError(f"learner step {self.state.step + 1} failed: {type(cause).__name__}: "
                           f"{' '.join(str(cause).split())[:500]}; its weights were not updated; checkpoints and "
                           f"traces are in {self.plan.run_dir}") from None
        finally:
            self._learner_busy = False

    # ---- dealing and receiving -----------------------------------------------------------------
    def _feed(self, short: int) -> None:
        """Deal groups: async tops every worker up; sync deals what the step still lacks."""
        ready = [wid for wid in self.pool.live() if wid not in self.awaiting_weights]
        if not ready:
            return
        if self.cfg.train.mode == "async":
            for wid in ready:
                self._deal(wid, self.cfg.rollout.max_inflight_groups - self.ledger.held_by(wid))
            return
        in_flight = sum(self.ledger.held_by(wid) for wid in self.pool.live())
        need = short - in_flight
        for i in range(max(0, need)):
            self._deal(ready[i % len(ready)], 1)

    def _deal(self, wid: int, k: int) -> None:
        if k <= 0:
            return
        groups, self.backlog = self.backlog[:k], self.backlog[k:]
        groups += self.stream.deal(k - len(groups))
        self.ledger.deal(wid, groups)
        self.pool.submit(wid, groups)

    def _pump(self, wait_s: float, limit: int) -> int:
        """Receive up to ``limit`` finished groups (waiting up to ``wait_s`` for the first); log them.

        Never more than the loop can use: a group left in the queue at the end was never logged.
        """
        from ray.util.queue import Empty

        self._handle(self.pool.check())
        try:
            items = [self.queue.get(block=True, timeout=wait_s)]
        except Empty:
            return 0
        more = min(self.queue.qsize(), limit - 1)
        if more > 0:
            items += self.queue.get_nowait_batch(more)
        for group in items:
            self.trace_log.add(group.traces)
            self._step_counters.tokens += group.num_tokens
            self.ledger.receive(group)
        return len(items)

    # ---- failures ------------------------------------------------------------------------------
    def _handle(self, health: Health) -> None:
        for wid in health.restarted:
            self.state.worker_restarts += 1
            print(f"sliderl: rollout worker {wid} restarted (pid {self.pool.pids.get(wid)}); "
                  "sending weights and re-issuing its groups", flush=True)
            self.backlog += self.ledger.orphans(wid)
            if not self.weight_sync.catch_up(self.state.published_version, self.pool.handles[wid]):
                self.awaiting_weights.add(wid)
        for wid in health.died:
            self.backlog += self.ledger.orphans(wid)
            self.awaiting_weights.discard(wid)
            if not self.pool.live():
                raise RunError(f"every rollout worker died (restarts used up: rollout.max_restarts="
                               f"{self.cfg.rollout.max_restarts}); checkpoints and traces are in {self.plan.run_dir}")
        if self.awaiting_weights and not self._learner_busy:
            self._publish()

    def _publish(self) -> float:
        self._learner_call(self.learner.version.remote())  # a dead learner is LearnerLost, not a worker failure
        report = self.weight_sync.publish(self.state.version, self.learner, self.pool.live())
        self.state.published_version = self.state.version
        self.awaiting_weights -= set(self.pool.live()) - set(report.failed)
        return report.seconds

    # ---- checkpoints, eval, metrics ------------------------------------------------------------
    def _checkpoint(self) -> PurePath | None:
        """The learner writes its part to the storage root from its own node, then the driver its state and
        the marker; metrics.jsonl follows to a remote root. A save that fails (a full or read-only disk) leaves
        no marker, so a resume picks the checkpoint before it; checkpoint.on_error says whether the run stops."""
        from ray.exceptions import RayTaskError

        step = self.state.step
        try:
            self.trace_log.flush()  # every group the checkpoint resolves is in the log
            path = self.checkpoints.save(step, self._snapshot(),
                                         lambda where: self._learner_call(self.learner.save_checkpoint.remote(where)))
        except (OSError, RayTaskError) as err:
            failed_save(self.checkpoints, step, err, self.cfg.checkpoint.on_error, self.plan.run_dir)
            return None
        self.plan.push_driver_files()
        return path

    def _snapshot(self) -> DriverState:
        undealt = [int(g.group_id[1:]) for g in self.backlog if g.group_id not in self.ledger.outstanding]
        return replace(self.state, cursor=self.stream.cursor, ledger=self.ledger.state(),
                       outstanding=sorted(self.ledger.outstanding_indices() + undealt))

    def _learner_call(self, ref):
        import ray
        from ray.exceptions import RayActorError

        try:
            return ray.get(ref)
        except RayActorError as err:
            raise LearnerLost(actor_death(err)) from None

    def _evaluate(self, label: str) -> EvalResult:
        import ray

        problems, live = self.plan.eval_problems, list(self.pool.live().items())
        # contiguous shares, one per live worker, generated at once (each request's sampling is seeded by the
        # request, not by its batch, so the split does not change what is generated)
        n, k = len(problems), len(live)
        shares = [(wid, worker, problems[i * n // k:(i + 1) * n // k]) for i, (wid, worker) in enumerate(live)]
        shares = [(wid, worker, share) for wid, worker, share in shares if share]
        refs = [worker.evaluate.remote([p.engine_prompt for p in share], self.cfg.eval_sampling())
                for _, worker, share in shares]
        outputs = [out for ref in refs for out in ray.get(ref)]
        rows: list[dict] = []
        result = score(outputs, problems, self.cfg.verifier(), self.cfg.engine.kv, rows)
        path = self.plan.local_dir / EVAL_DIR / f"{label}.jsonl"  # every completion, to read what the number counts
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps({"version": self.state.version, **row}) + "\n" for row in rows))
        workers = ", ".join(str(wid) for wid, _, _ in shares)
        print(f"sliderl: eval {label} (version {self.state.version}, workers {workers}): {result.line()} -> {path}",
              flush=True)
        return result

    def _report(self, batch: list[RolloutGroup], trained_at: int, sync_seconds: float | None,
                learner: StepMetrics, release_seconds: float | None = None) -> StepReport:
        traces = [t for g in batch for t in g.traces]
        ages = [trained_at - g.policy_version for g in batch]
        counters, self._step_counters = self._step_counters, _Counters()
        eval_before, self._unlogged_eval_before = self._unlogged_eval_before, None
        return StepReport(
            reward=_mean(t.reward for t in traces),
            accuracy=_mean(float(t.reward_components.get("correctness", 0.0) >= 1.0) for t in traces),
            visible_kv=_mean(t.mean_visible_kv for t in traces),
            peak_visible_kv=_mean(t.peak_visible_kv for t in traces),
            completion_tokens=_mean(t.num_tokens for t in traces),
            preempted_traces=_mean(float(t.num_preemptions > 0) for t in traces),
            prompt_tokens=_mean(len(t.prompt_token_ids) for t in traces),
            speedup=_geomean(t.reward_components.get("speedup") for t in traces),
            trained_groups=len(batch),
            kv_token_steps=_mean(t.kv_token_steps for t in traces),
            restarts=_mean(len(t.restarts) for t in traces),
            reencoded_tokens=_mean(t.reencoded_tokens for t in traces),
            max_token_seconds=_mean(t.max_token_seconds for t in traces),
            rollout_tokens_per_s=counters.tokens / max(time.monotonic() - counters.since, 1e-9),
            stale_groups_dropped=counters.stale,
            staleness_mean=_mean(ages),
            staleness_max=max(ages),
            queue_depth=self.queue.qsize(),
            version=self.state.version,
            worker_restarts=self.state.worker_restarts,
            learner_restarts=self.state.learner_restarts,
            duplicate_groups=len(self.ledger.duplicates),
            reissued_groups=len(self.ledger.reissued),
            learner_step_seconds=learner.step_seconds,
            weight_sync_seconds=sync_seconds,
            memory_release_seconds=release_seconds,
            learner=learner,
            eval_before=eval_before,
            eval_after=self.eval_after if self.state.step == self.cfg.train.steps else None,
        )


@dataclass
class _Counters:
    """Per-step tallies, reset after every step."""

    tokens: int = 0
    stale: int = 0
    since: float = 0.0

    def __post_init__(self) -> None:
        self.since = time.monotonic()


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else 0.0


def _geomean(values) -> float | None:
    """Geometric mean of positive finite values; None when any is missing (or none is given)."""
    values = list(values)
    if not values or not all(_is_number(v) and 0 < v < math.inf for v in values):
        return None
    return math.exp(sum(math.log(v) for v in values) / len(values))


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
