"""SFT stage settings: the warm start of ``sliderl train`` and the ``sliderl sft`` job.

A stage is (prompt, completion) data — pairs, or chat conversations whose last assistant message is
the completion — ``trainer.LearnerArgs`` (algo sft) and ``trainer.sft.SFTArgs``; ``cluster.run.sft_job``
runs it with the one trainer. Prompts are written as the rollouts write them: the warm start by the
train job's ``data`` settings, ``sliderl sft`` by its own (``cluster.config.prompts.PromptSettings``).
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import Field, NonNegativeFloat, field_validator, model_validator

from sliderl.cluster.config.base import ModelSource, Section, TinyModel, run_folder
from sliderl.cluster.config.prompts import PromptSettings
from sliderl.cluster.config.task import GENERATED_TASKS, ArithTaskConfig, TaskSource
from sliderl.cluster.storage.data import check_source
from sliderl.cluster.storage.data_files import DEFAULT_MAX_LINE_BYTES
from sliderl.cluster.storage.root import check_location
from sliderl.trainer.algorithms import SFTOptions
from sliderl.trainer.learner_args import LearnerArgs
from sliderl.trainer.sft import SFT_ALGORITHMS, SFTArgs, policy_record, policy_specs

DEFAULT_CACHE = "~/.cache/sliderl"


class SFTData(Section):
    """(prompt, completion) pairs for an SFT stage: a task's solutions, or a file of pairs or of chat conversations."""

    source: str = "task"
    """task: the task's reference solutions (arith, regmachine, pasta); else a local .jsonl/.json/.parquet file or folder
    (or a hub dataset name, online) of prompt/completion columns or of chat messages (messages_field)."""
    task_solution: str = "solution"
    """source=task: which reference solution is the completion (regmachine: solution = lazy ``<reg_i>``
    annotations, TIP's SFT target; solution_dense = the same lines without registers, the Dense
    baseline's; solution_optimal = the optimal schedule; pasta: solution = Pasta-Lang annotated, solution_plain =
    without tags, Baseline-SFT's)."""
    prompt_field: str = "prompt"
    """Column holding the prompt (files only)."""
    completion_field: str = "completion"
    """Column holding the target completion; the end-of-sequence token is appended (files only)."""
    messages_field: str = "messages"
    """Column of chat conversations ([{role, content}, ...]); a file that has it is chat data: the prompt is
    every message before the last one, which must be the assistant's, through the chat template with the
    generation prompt, and the completion is that last message's content (+ eos)."""
    held_out: int = Field(64, ge=1)
    """Examples kept out of training and scored at each check (task: the problems after the trained
    ones; files: the last rows)."""
    skip_invalid: bool = False
    """Leave out (counted and printed) rows without a prompt or completion (missing, null or blank) and
    examples longer than the model's context, instead of stopping with an error naming the first one."""
    max_line_bytes: int = Field(DEFAULT_MAX_LINE_BYTES, ge=1)
    """Longest line of a local .jsonl/.json file, in bytes: a longer line is refused before anything is loaded
    (loading a row takes hundreds of times its size in memory)."""

    @field_validator("source")
    @classmethod
    def _exists(cls, source: str) -> str:
        return check_source(source)


class SFTJobData(PromptSettings, SFTData):
    """``sliderl sft``'s data: the pairs and how their prompts are written (as ``sliderl train`` would write them)."""


class SFTStage(Section):
    """Supervised fine-tuning with ``trainer.Learner`` and the SFT algorithm on (prompt, completion) data."""

    data: SFTData = Field(default_factory=SFTData)
    """Where the pairs come from."""
    learner: LearnerArgs = Field(default_factory=lambda: LearnerArgs(algo=SFTOptions()))
    """The learner's settings (``trainer.LearnerArgs``; algo sft, or planned_diffusion for span-annotated data)."""
    sft: SFTArgs = Field(default_factory=SFTArgs)
    """Steps, batch size and the held-out stopping rule (``trainer.sft.SFTArgs``)."""

    @model_validator(mode="before")
    @classmethod
    def _learner_defaults(cls, data: Any) -> Any:
        """The stage's learner runs SFT, its schedule over sft.steps, unless the file says otherwise."""
        if isinstance(data, dict) and isinstance(data.get("learner"), dict):
            sft = data.get("sft") if isinstance(data.get("sft"), dict) else {}
            defaults = {"algo": {"type": "sft"}, "total_steps": sft.get("steps", SFTArgs.steps)}
            data = {**data, "learner": {**defaults, **data["learner"]}}
        return data

    @field_validator("learner")
    @classmethod
    def _is_sft(cls, learner: LearnerArgs) -> LearnerArgs:
        if learner.algo.type not in SFT_ALGORITHMS:
            raise ValueError(f"an SFT stage trains with algo type sft, got {learner.algo.type!r} (planned_diffusion, "
                             "the hybrid objective on span-annotated data, is the other valid type)")
        return learner



class WarmStartConfig(SFTStage):
    """An SFT stage on ``model`` before RL, on its own Ray actor, its checkpoint cached by everything that
    shapes its weights; its prompts are written as the rollouts' are (data.template, data.chat_template, ...)."""

    enabled: bool = False
    """Run the stage (or reuse its cached checkpoint) and start RL from it; its visibility is engine.kv."""
    cache_dir: str = f"{DEFAULT_CACHE}/warmstart"
    """Folder of warm-started checkpoints, one subfolder per fingerprint, reused when present: a local
    folder on the node the stage's actor runs on, or a storage URI every node reads (s3://bucket/cache). A
    fingerprint with a checkpoint bundled with sliderl (the default job's) is copied here from the package."""
    num_cpus: float = Field(1.0, ge=0)
    """CPUs reserved for the stage's actor; also its torch thread count (at least 1)."""
    num_gpus: float = Field(0, ge=0)
    """GPUs reserved for the stage's actor; > 0 needs warmstart.learner.device=cuda."""
    resources: dict[str, NonNegativeFloat] = {}
    """Custom Ray resources of the stage's actor, e.g. {node_b: 1} (a node started with
    ``ray start --resources='{"node_b": 4}'``)."""

    @field_validator("cache_dir")
    @classmethod
    def _cache_location(cls, cache_dir: str) -> str:
        return check_location(cache_dir)


class SFTJobConfig(SFTStage):
    """``sliderl sft``: fine-tune ``model`` on (prompt, completion) pairs (recipe: configs/sft-tiny-arith.yaml)."""

    RECIPE: ClassVar[str] = "sft-tiny-arith.yaml"

    data: SFTJobData = Field(default_factory=SFTJobData)
    """Where the pairs come from, and how prompts are written (raw template or the chat template)."""
    model: ModelSource = Field(default_factory=TinyModel)
    """Initial weights: type tiny (random, built locally) or hf (a local directory)."""
    task: TaskSource = Field(default_factory=ArithTaskConfig)
    """With data.source=task: the generated task (arith, regmachine, pasta) whose reference solutions are the pairs."""
    kv: str | list[str] = "full"
    """Visibility every example is trained under (the KV policy its rollouts will use), e.g. prefix_sliding:24; or
    a list, e.g. [prefix_sliding:512, full]: example i (and held-out example i) is trained under the (i mod n)-th,
    so that one model decodes under each."""
    output_dir: str = Field(default_factory=run_folder("sft"))
    """Where config.yaml, the checkpoint (model/) and sft.json (steps, held-out checks, losses) are written."""

    @field_validator("kv")
    @classmethod
    def _canonical_kv(cls, spec: str | list[str]) -> str | list[str]:
        return policy_record(policy_specs(spec))

    @model_validator(mode="after")
    def _data_has_solutions(self) -> SFTJobConfig:
        if self.data.source == "task" and self.task.type not in GENERATED_TASKS:
            raise ValueError("data.source=task needs task.type=arith, regmachine or pasta (its reference solutions are the pairs); "
                             "point data.source at a file of prompt/completion pairs")
        return self
