"""The config of ``sliderl train`` and ``sliderl eval``: ``TrainConfig``.

It composes the records of the parts it drives — ``EngineArgs``, ``SamplingParams``,
``LearnerArgs`` (with the algorithm's options), ``RewardSpec``, the task (``cluster.config.task``),
the warm start's SFT stage (``cluster.config.sft``) — and adds the sections only the cluster has
(rollout workers, the driver loop, weight sync, checkpoints, Ray, monitoring, eval). The job's own
values live in ``configs/tiny-arith.yaml``, the recipe run when no file is given. Only the resource fields
(``rollout.num_cpus/num_gpus``, ``learner.num_cpus/num_gpus``) decide what Ray reserves.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Literal

from pydantic import Field, NonNegativeFloat, field_validator, model_validator

from sliderl.cluster.config.base import ModelSource, Section, TinyModel, base_record, run_folder
from sliderl.cluster.config.compare import CompareConfig
from sliderl.cluster.config.monitor import MonitorConfig
from sliderl.cluster.config.sft import WarmStartConfig
from sliderl.cluster.config.task import GENERATED_TASKS, ArithTaskConfig, DataConfig, TaskSource
from sliderl.cluster.storage.root import check_location
from sliderl.rewards.spec import CorrectnessTerm, RewardSpec
from sliderl.rollout.engine_args import EngineArgs
from sliderl.rollout.sampling import SamplingParams
from sliderl.trainer.learner_args import LearnerArgs


class RolloutConfig(Section):
    """Rollout workers: each wraps one engine, scores its traces and streams whole groups."""

    num_workers: int = Field(2, ge=1)
    """Rollout worker actors."""
    group_size: int = Field(8, ge=1)
    """Samples per prompt (a group; the learner's atomic unit)."""
    max_inflight_groups: int = Field(4, ge=1)
    """Groups one worker holds at once (async mode keeps it topped up)."""
    queue_size: int = Field(8, ge=1)
    """Finished groups the trace queue holds before workers block (back-pressure)."""
    num_cpus: float = Field(0.5, ge=0)
    """CPUs reserved per worker (its placement-group bundle); also its torch thread count (at least 1)."""
    num_gpus: float = Field(0, ge=0)
    """GPUs reserved per worker; > 0 needs engine.device=cuda."""
    max_restarts: int = Field(3, ge=0)
    """Times Ray restarts a worker whose process died (then its prompts go to the others)."""
    backend: str = "paged"
    """The generation engine, a name in ``rollout.backend.ENGINES``: paged, sliderl's bounded-KV engine
    (``rollout.LLM``); a dense-rollout engine such as vLLM would register there under its own name."""
    release_between_steps: bool = False
    """train.mode=sync, for a learner that shares the workers' GPU: each worker frees its KV pool and CUDA
    graphs before the learner steps and allocates them again after the weight sync, so the learner can use
    that memory meanwhile (its cached memory is handed back after each step). Costs an allocation and a
    graph capture per step; false keeps the pool, sized by engine.kv_cache_gb to leave the learner room
    (benchmarks/colocate.py measures both)."""
    resources: dict[str, NonNegativeFloat] = {}
    """Custom Ray resources per worker bundle, e.g. {node_b: 1} to place workers on nodes started with
    ``ray start --resources='{"node_b": 4}'``."""

    @field_validator("backend")
    @classmethod
    def _known_backend(cls, name: str) -> str:
        from sliderl.rollout.backend import ENGINES

        if name not in ENGINES:
            raise ValueError(f"unknown rollout backend {name!r}; valid: {', '.join(ENGINES)} (a dense-rollout engine "
                             "such as vLLM is not built in; sliderl/rollout/backend.py says how one plugs in)")
        return name


# ------------------------------------------------------------------------------- actors and loop


@dataclasses.dataclass(frozen=True)
class LearnerSection(LearnerArgs):
    """The learner actors: ``trainer.LearnerArgs`` plus how many ranks and the resources each rank's
    placement-group bundle reserves."""

    num_ranks: int = 1
    """Learner ranks, one actor each (one GPU each on CUDA), forming one torch.distributed process group
    (NCCL on GPU, gloo on CPU) that shards the model, gradients and AdamW state with FSDP2; 1: one process,
    the plain model (unless fsdp=always or offload=cpu)."""
    shard_ranks: int | None = None
    """Ranks that shard one copy of the model, gradients and AdamW state (FSDP2 on a 2D mesh, HSDP): the
    num_ranks / shard_ranks copies each sum their gradients over their own ranks, then across copies. Shard
    within a node (e.g. 8 on 2 nodes x 8 GPUs; consecutive ranks share a node): parameter gathers and gradient
    reduce-scatters then stay on the node and only an all-reduce of each shard crosses nodes, for 16·P/shard_ranks
    bytes of state per rank instead of 16·P/num_ranks. Must divide num_ranks; None: num_ranks (one copy)."""
    fsdp: Literal["auto", "always"] = "auto"
    """auto: FSDP2 when num_ranks > 1 or offload=cpu; always: at one rank too (float32 masters are then the
    sharded parameters: 16 bytes per parameter with AdamW, without the plain learner's float32 gradient copy)."""
    collective_timeout_s: float = 600.0
    """Longest any collective of the learner ranks may wait (> 0); a rank that died or hangs is then taken
    as lost, and the group restarts from the latest checkpoint. Must exceed the longest step imbalance."""
    num_cpus: float = 1.0
    """CPUs reserved per learner rank (its placement-group bundle); also its torch thread count."""
    num_gpus: float = 0.0
    """GPUs reserved per learner rank; > 0 needs learner.device=cuda."""
    resources: dict[str, float] = dataclasses.field(default_factory=dict)
    """Custom Ray resources of every learner rank's bundle, e.g. {node_b: 1} (a node started with
    ``ray start --resources='{"node_b": 4}'``)."""
    rank_resources: list[dict[str, float]] = dataclasses.field(default_factory=list)
    """Per-rank custom resources added to resources: entry r to rank r's bundle, e.g. [{node_a: 1}, {node_b: 1}]
    puts rank 0 on node a and rank 1 on node b; empty: the placement group packs the ranks."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("num_cpus", "num_gpus"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if any(not amount >= 0 for amount in self.resources.values()):
            raise ValueError(f"resources must be >= 0, got {self.resources}")
        if not (isinstance(self.num_ranks, int) and self.num_ranks >= 1):
            raise ValueError(f"num_ranks must be an integer >= 1, got {self.num_ranks!r}")
        if not self.collective_timeout_s > 0:
            raise ValueError(f"collective_timeout_s must be > 0, got {self.collective_timeout_s}")
        if self.shard_ranks is not None and not (isinstance(self.shard_ranks, int) and self.shard_ranks >= 1
                                                 and self.num_ranks % self.shard_ranks == 0):
            divisors = [d for d in range(1, self.num_ranks + 1) if self.num_ranks % d == 0]
            raise ValueError(f"shard_ranks must divide num_ranks={self.num_ranks} (one of {divisors}) or be None, "
                             f"got {self.shard_ranks!r}")
        if self.rank_resources and len(self.rank_resources) != self.num_ranks:
            raise ValueError(f"rank_resources must list one entry per rank (num_ranks={self.num_ranks}) or none, "
                             f"got {len(self.rank_resources)}: {self.rank_resources}")
        if any(not amount >= 0 for own in self.rank_resources for amount in own.values()):
            raise ValueError(f"rank_resources must be >= 0, got {self.rank_resources}")

    @property
    def sharded(self) -> bool:
        """The learner runs FSDP2 (a process group, even of one rank)."""
        return self.num_ranks > 1 or self.fsdp == "always" or self.offload != "none"

    def args(self) -> LearnerArgs:
        """The ``LearnerArgs`` part."""
        return base_record(self, LearnerArgs)


class LoopConfig(Section):
    """The driver loop: how rollouts and learner steps interleave."""

    mode: Literal["sync", "async"] = "async"
    """sync: generate a step's groups, train, sync weights, repeat; async: workers keep generating
    while the learner trains, stale groups are dropped."""
    steps: int = Field(120, ge=1)
    """Learner optimizer steps in the run (the final step when resuming)."""
    groups_per_step: int = Field(8, ge=1)
    """Groups per learner step."""
    max_staleness: int = Field(2, ge=0)
    """async: drop a group sampled more than this many policy versions before the step trains it."""
    sync_every: int = Field(1, ge=1)
    """Publish the learner's weights to the workers every this many steps (sync mode: must be 1)."""
    seed: int = Field(0, ge=0)
    """Seeds the prompt order and every rollout sample (the learner's torch seed is learner.seed)."""
    group_timeout_s: float = Field(600, gt=0)
    """Stop with an error when no group arrives for this long."""
    health_check_s: float = Field(1.0, gt=0)
    """How often the driver checks that every rollout worker is alive and the same process."""
    max_learner_restarts: int = Field(1, ge=0)
    """Times a dead learner is recreated from the latest checkpoint (with fresh workers) before the run stops."""
    max_stale_streak: int | None = Field(None, ge=1)
    """Stop with an error once this many groups in a row arrived too stale to train (the run would spin,
    generating only groups it drops); None: twice the groups that can wait at once (in flight, queued, a step's)."""

    @property
    def staleness_limit(self) -> int:
        """The most versions a trained group may lag: max_staleness in async mode, 0 in sync mode (each step's
        groups are generated with the newest weights)."""
        return 0 if self.mode == "sync" else self.max_staleness


class WeightSyncConfig(Section):
    """How new weights reach the rollout workers."""

    backend: Literal["object_store", "cuda_ipc", "broadcast"] = "object_store"
    """object_store: through Ray's object store (any placement); cuda_ipc: GPU memory handles
    (learner and workers on one node, CUDA); broadcast: a torch.distributed broadcast from the
    learner (NCCL on GPU, gloo on CPU)."""
    broadcast_backend: Literal["auto", "nccl", "gloo"] = "auto"
    """broadcast: the process-group backend; auto is nccl when the learner runs on cuda, else gloo."""
    timeout_s: float = Field(300, gt=0)
    """Longest a sync may take before it is an error."""


class CheckpointConfig(Section):
    """Learner checkpoints (HF layout + optimizer, version, RNG) and the driver state beside them."""

    every: int = Field(10, ge=0)
    """Save every this many steps (0: only at the end); the last step is always saved."""
    keep: int = Field(2, ge=1)
    """Complete checkpoints kept; older ones are deleted."""
    on_error: Literal["stop", "continue"] = "stop"
    """A checkpoint that cannot be written (a full or read-only disk): stop (exit 1, saying which write failed;
    the previous checkpoint stays the one a resume picks) or continue the run without it (a warning)."""


class RayConfig(Section):
    """Where the actors run."""

    address: str | None = None
    """Existing cluster (host:port of its GCS, or auto); None uses RAY_ADDRESS when set (as under
    ``ray job submit``), else starts a local Ray instance."""
    num_cpus: int | None = Field(2, ge=1)
    """CPUs of a local Ray instance (ignored when connecting); None lets Ray count them."""
    num_gpus: int | None = Field(None, ge=0)
    """GPUs of a local Ray instance (ignored when connecting); None lets Ray count them."""
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    """How the placement group spreads the learner and worker bundles over nodes."""
    placement_timeout_s: float = Field(60, gt=0)
    """Longest to wait for the placement group before giving up with an error."""
    env_vars: dict[str, str] = {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    """Environment of every actor (set through the runtime_env)."""


class EvalConfig(Section):
    """Accuracy on the eval split: before and after training (greedy, one completion per problem),
    ``sliderl eval CHECKPOINT`` (the same), and ``sliderl eval COMPARE.yaml`` (``compare``: k samples)."""

    num_problems: int = Field(256, ge=1)
    """Eval problems scored (the first ones of the eval split)."""
    before: bool = True
    """Score the initial weights before the first step."""
    after: bool = True
    """Score the final weights after the last step."""
    temperature: float = Field(0.0, ge=0)
    """Sampling temperature of eval (0: greedy)."""
    max_tokens: int | None = Field(None, ge=1)
    """Longest eval completion; None uses sampling.max_tokens."""
    compare: CompareConfig = Field(default_factory=CompareConfig)
    """``sliderl eval COMPARE.yaml``: the entries (checkpoint, KV policy) to compare and how they are
    sampled (k, temperature, top_p, seeds); not used by the train job."""


# ----------------------------------------------------------------------------------- top level


def _reward_shorthand(reward: Any) -> Any:
    """``{correctness: 1.0}`` means ``{correctness: {weight: 1.0}}``."""
    if not isinstance(reward, dict):
        return reward
    return {k: {"weight": v} if isinstance(v, (int, float)) and not isinstance(v, bool) else v
            for k, v in reward.items()}


class TrainConfig(Section):
    """``sliderl train``: RL with bounded-KV rollouts on Ray (recipe: configs/tiny-arith.yaml)."""

    RECIPE: ClassVar[str] = "tiny-arith.yaml"

    task: TaskSource = Field(default_factory=ArithTaskConfig)
    """What is learned: type arith, regmachine or pasta (generated problems) or math (data.source with reference answers)."""
    data: DataConfig = Field(default_factory=DataConfig)
    """Prompt and eval datasets."""
    model: ModelSource = Field(default_factory=TinyModel)
    """Initial weights (before the warm start, when enabled): type tiny (random) or hf (a local directory)."""
    warmstart: WarmStartConfig = Field(default_factory=WarmStartConfig)
    """SFT stage on the task's reference solutions before RL."""
    engine: EngineArgs = Field(default_factory=EngineArgs)
    """Rollout engine construction arguments (``rollout.EngineArgs``; one engine per worker, seed + 7919 * worker)."""
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    """How rollouts are sampled (``rollout.SamplingParams``; seed must stay null: sample j of a group
    gets the group's seed + j, from train.seed)."""
    reward: RewardSpec = Field(default_factory=RewardSpec)
    """Reward terms and weights (``rewards.RewardSpec``): correctness is the task's verifier; kv_penalty,
    thinking_penalty, cost_penalty and speedup are cost terms. A number is a term's weight: {correctness: 1.0}."""
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    """Rollout workers and the trace queue."""
    learner: LearnerSection = Field(default_factory=LearnerSection)
    """The learner actor (``trainer.LearnerArgs`` + resources); vocab_policy null means engine.kv,
    total_steps left out means train.steps."""
    train: LoopConfig = Field(default_factory=LoopConfig)
    """The driver loop."""
    weight_sync: WeightSyncConfig = Field(default_factory=WeightSyncConfig)
    """How weights reach the workers."""
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    """Checkpoint cadence."""
    ray: RayConfig = Field(default_factory=RayConfig)
    """Cluster connection and placement."""
    monitor: MonitorConfig = Field(default_factory=MonitorConfig)
    """Metrics, W&B, dashboard, plots."""
    eval: EvalConfig = Field(default_factory=EvalConfig)
    """Before/after evaluation."""
    run_dir: str = Field(default_factory=run_folder("train"))
    """The run's storage root: config.yaml, traces/, checkpoints/, driver_state.json, metrics.jsonl and
    plots. A local folder (one node, or a folder every node mounts; use an absolute path under ``ray
    job submit``: the job's working directory is a temporary copy) or a URI every node can reach:
    s3://bucket/prefix, gs://bucket/prefix, abfs://…, hdfs://… (see docs/guide.md: storage root)."""
    resume: bool = False
    """Continue from the latest complete checkpoint in run_dir (its step, data cursor, weights)."""

    @field_validator("run_dir")
    @classmethod
    def _storage_root(cls, run_dir: str) -> str:
        return check_location(run_dir)

    @model_validator(mode="before")
    @classmethod
    def _job_defaults(cls, data: Any) -> Any:
        """Reward shorthand ``{correctness: 1.0}``; the learner's schedule over train.steps unless set."""
        if not isinstance(data, dict):
            return data
        data = {**data, "reward": _reward_shorthand(data["reward"])} if "reward" in data else dict(data)
        if isinstance(data.get("learner"), dict) and "total_steps" not in data["learner"]:
            train = data.get("train") if isinstance(data.get("train"), dict) else {}
            data["learner"] = {**data["learner"], "total_steps": train.get("steps", LoopConfig.model_fields["steps"].default)}
        return data

    @model_validator(mode="after")
    def _consistent(self) -> TrainConfig:
        self._check_loop()
        self._check_task()
        self._check_reward()
        self._check_algorithm()
        self._check_devices()
        self._resolve_learner()
        return self

    def _resolve_learner(self) -> None:
        """vocab_policy null -> engine.kv: resolved here, so --help and config.yaml show exactly what the
        learner actor is built with."""
        if self.learner.vocab_policy is None:
            self.learner = dataclasses.replace(self.learner, vocab_policy=self.engine.kv)

    def stale_drop_warning(self) -> str | None:
        """async: a note when more groups are in flight than the staleness limit can train, else None.

        While generation is the bottleneck, ``F`` groups in flight over all workers finish at F per group's
        generation time, i.e. F / G learner steps (G = ``groups_per_step``) pass while one group generates: it
        arrives about F / G versions old, so past ``max(max_staleness, 1) x G`` groups in flight the surplus is
        generated only to be dropped (measured on the CPU under max_staleness 1: G in flight dropped 1 of 17
        arrived groups, 2 x G 3 of 15, 4 x G 13 of 25; docs/notebook/benchmarks.md, issue 15)."""
        if self.train.mode != "async":
            return None
        in_flight = self.rollout.num_workers * self.rollout.max_inflight_groups
        trainable = max(self.train.max_staleness, 1) * self.train.groups_per_step  # one step's worth always fits
        if in_flight <= trainable:
            return None
        fits = max(1, trainable // self.rollout.num_workers)
        return (f"{in_flight} groups in flight (rollout.num_workers={self.rollout.num_workers} x "
                f"rollout.max_inflight_groups={self.rollout.max_inflight_groups}) arrive about "
                f"{in_flight / self.train.groups_per_step:g} versions old (in flight / train.groups_per_step="
                f"{self.train.groups_per_step}), past train.max_staleness={self.train.max_staleness}: expect many "
                f"to be dropped as stale. Keep in flight <= max(max_staleness, 1) x groups_per_step = {trainable} "
                f"(rollout.max_inflight_groups={fits}), or raise train.max_staleness or train.groups_per_step")

    def _check_loop(self) -> None:
        if self.train.mode == "sync" and self.train.sync_every != 1:
            raise ValueError(f"train.mode=sync generates every step with the newest weights, so train.sync_every "
                             f"must be 1, got {self.train.sync_every} (use train.mode=async for delayed syncs)")
        if self.train.mode == "async" and self.train.max_staleness < self.train.sync_every - 1:
            raise ValueError(f"train.max_staleness={self.train.max_staleness} would drop every group between "
                             f"weight syncs (train.sync_every={self.train.sync_every}); it must be >= sync_every - 1")
        if self.rollout.release_between_steps and self.train.mode != "sync":
            raise ValueError("rollout.release_between_steps=true frees the workers' KV pools while the learner steps, "
                             f"which only train.mode=sync leaves idle; got train.mode={self.train.mode} (set "
                             "train.mode=sync, or release_between_steps=false)")
        if self.sampling.seed is not None:
            raise ValueError(f"sampling.seed={self.sampling.seed}: rollout seeds come from train.seed (sample j of "
                             "a group gets the group's seed + j); leave sampling.seed null")

    def _check_task(self) -> None:
        if self.warmstart.enabled and self.warmstart.data.source == "task" and self.task.type not in GENERATED_TASKS:
            raise ValueError(f"warmstart.data.source=task trains on a generated task's reference solutions; with "
                             f"task.type={self.task.type} point warmstart.data.source at a file of prompt/completion "
                             "pairs, or set warmstart.enabled=false")
        if self.task.type == "math" and self.data.source == "task":
            raise ValueError("task.type=math has no problem generator: set data.source to a dataset "
                             "(a .jsonl/.parquet path or a hub name)")
        if self.task.type in GENERATED_TASKS and self.data.source == "task" and self.data.eval_source is None \
                and self.eval.num_problems > self.task.eval_size:
            raise ValueError(f"eval.num_problems={self.eval.num_problems} but the task writes only "
                             f"task.eval_size={self.task.eval_size} eval problems; raise task.eval_size")

    def _check_reward(self) -> None:
        if self.reward.speedup is not None and self.engine.kv != "pasta":
            raise ValueError(f"reward.speedup is the critical path of a Pasta-Lang response as the Pasta runtime decodes "
                             f"it: it needs engine.kv=pasta, got engine.kv={self.engine.kv}")

    def _check_algorithm(self) -> None:
        """Settings the learner would refuse only at its first step, inside its actor."""
        algo, components = self.learner.algo, [t for t in RewardSpec.TERMS if getattr(self.reward, t) is not None]
        if algo.type in ("grpo", "bonbon") and self.rollout.group_size < 2:
            why = ("GRPO's advantage is a sample's reward minus its group's mean" if algo.type == "grpo"
                   else "BoNBoN pairs the best and the worst sample of a group")
            raise ValueError(f"rollout.group_size=1 with learner.algo.type={algo.type}: {why}, so a group of one "
                             "never trains; use rollout.group_size >= 2 (the recipes use 8)")
        if algo.type == "bonbon":
            for key in ("speedup_key", "quality_key"):
                name = getattr(algo, key)
                if name is not None and name not in components:
                    fix = ("learner.algo.speedup_key=null to rank by quality alone, or add reward.speedup (Pasta's "
                           "speedup, with engine.kv=pasta)") if key == "speedup_key" else "a term of the reward"
                    raise ValueError(f"learner.algo.{key}={name!r}: BoNBoN ranks samples by the reward component "
                                     f"{name!r}, but the reward has only {', '.join(components)}; set {fix}")
        if self.engine.kv == "pasta" and self.learner.window_mode != "full":
            raise ValueError(f"engine.kv=pasta trains on the whole trace only (its forks' keys and positions span it), "
                             f"but learner.window_mode={self.learner.window_mode}; set learner.window_mode=full")

    def _check_devices(self) -> None:
        if self.rollout.num_gpus > 0 and not self.engine.device.startswith("cuda"):
            raise ValueError(f"rollout.num_gpus={self.rollout.num_gpus} reserves GPUs but engine.device is "
                             f"{self.engine.device!r}; set engine.device=cuda")
        if self.warmstart.enabled and self.warmstart.num_gpus > 0 and not self.warmstart.learner.device.startswith("cuda"):
            raise ValueError(f"warmstart.num_gpus={self.warmstart.num_gpus} reserves GPUs but warmstart.learner.device "
                             f"is {self.warmstart.learner.device!r}; set warmstart.learner.device=cuda")
        if self.learner.num_gpus > 0 and not self.learner.device.startswith("cuda"):
            raise ValueError(f"learner.num_gpus={self.learner.num_gpus} reserves GPUs but learner.device is "
                             f"{self.learner.device!r}; set learner.device=cuda")
        self._check_learner_ranks()
        if self.weight_sync.backend == "cuda_ipc" and not (
                self.learner.device.startswith("cuda") and self.engine.device.startswith("cuda")):
            raise ValueError("weight_sync.backend=cuda_ipc shares GPU memory: it needs learner.device=cuda and "
                             "engine.device=cuda (use object_store or broadcast on CPU)")
        cpu = [key for key, device in (("learner.device", self.learner.device), ("engine.device", self.engine.device))
               if not device.startswith("cuda")]
        if self.weight_sync.backend == "broadcast" and self.weight_sync.broadcast_backend == "nccl" and cpu:
            raise ValueError(f"weight_sync.broadcast_backend=nccl moves GPU tensors between GPUs, but "
                             f"{' and '.join(cpu)}=cpu; use weight_sync.broadcast_backend=gloo (or auto), or put "
                             "learner and engine on cuda")

    def _check_learner_ranks(self) -> None:
        """Ranks on CUDA each need a GPU of their own (NCCL runs one rank per GPU); one rank may share its GPU."""
        learner = self.learner
        if learner.num_ranks == 1 or not learner.device.startswith("cuda"):
            return
        if learner.device != "cuda":
            raise ValueError(f"learner.device={learner.device} pins one GPU, but each of learner.num_ranks="
                             f"{learner.num_ranks} ranks uses the GPU Ray gives it: set learner.device=cuda")
        if learner.num_gpus != 1:
            raise ValueError(f"learner.num_gpus={learner.num_gpus:g}: each rank of a sharded learner "
                             f"(learner.num_ranks={learner.num_ranks}, NCCL) needs a GPU of its own, so "
                             "learner.num_gpus must be 1 (or learner.device=cpu, gloo)")

    # ---- the records the actors receive --------------------------------------------------------
    def learner_args(self) -> LearnerArgs:
        """What the learner actor is built with: the learner section without its resources."""
        return self.learner.args()

    def worker_engine_args(self, worker_id: int) -> EngineArgs:
        """Rollout worker ``worker_id``'s engine: its own seed, the rest shared."""
        return dataclasses.replace(self.engine, seed=self.engine.seed + 7919 * worker_id)

    def verifier(self):
        """The task's verifier (``score(RewardInput) -> RewardRecord``), as the correctness term builds it."""
        return (self.reward.correctness or CorrectnessTerm()).build(self.task.type)

    def eval_sampling(self) -> SamplingParams:
        """Eval's sampling: the rollout settings with eval's temperature and length, seeded by train.seed."""
        return dataclasses.replace(self.sampling, temperature=self.eval.temperature,
                                   max_tokens=self.eval.max_tokens or self.sampling.max_tokens, seed=self.train.seed)


__all__ = [
    "CheckpointConfig", "EvalConfig", "LearnerSection", "LoopConfig", "RayConfig", "RolloutConfig", "TrainConfig",
    "WeightSyncConfig",
]
