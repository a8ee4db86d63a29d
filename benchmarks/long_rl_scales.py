"""The sizes ``benchmarks/long_rl.py`` runs at (``--scale``): the GPU run, the CPU smoke run (the same pipeline at a
tiny size) and a tenth of the GPU run's trace on CPU; ``accuracy_vs_w.py --smoke`` and ``long_rl_pilot.py`` take
their settings from here."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Scale:
    """Sizes of one run: the GPU run, or the smoke run on CPU (the same pipeline at a tiny size)."""

    window: int
    sft: tuple[str, ...]  # overrides of configs/long-sft.yaml
    train: tuple[str, ...]  # overrides of configs/long-rl.yaml, every arm
    sft_examples: int  # distinct SFT pairs (the SFT cycles through them)
    train_prompts: int
    eval_problems: int
    arm_seconds: float  # the arms' deadline after they start, at most
    eval_reserve_s: float  # kept for the evaluations when the deadline is set from the budget
    windows: tuple[int, ...]  # accuracy vs W
    parallel_evals: int
    budget_s: float  # wall seconds for everything (the default of --budget-s)


GPU = Scale(window=512, sft=(), train=(), sft_examples=4800, train_prompts=512, eval_problems=64, arm_seconds=240,
            eval_reserve_s=110, windows=(128, 256, 512, 1024), parallel_evals=12, budget_s=540)
SMOKE_TASK = ("task.num_variables=3", "task.repeats=[3,4]", "task.num_registers=4", "task.lazy_registers=4")
SMOKE = Scale(
    window=16,
    sft=(*SMOKE_TASK, "model.hidden_size=32", "model.num_layers=2", "model.num_heads=2", "model.num_kv_heads=1",
         "model.intermediate_size=64", "model.max_position_embeddings=512", "learner.device=cpu",
         "learner.micro_batch_tokens=1024", "sft.steps=4", "sft.batch_size=4", "sft.check_every=4",
         "sft.log_every=1", "data.held_out=4"),
    train=(*SMOKE_TASK, "engine.device=cpu", "learner.device=cpu", "rollout.num_gpus=0", "learner.num_gpus=0",
           "rollout.num_cpus=0.5", "learner.num_cpus=0.5", "ray.num_cpus=2", "sampling.max_tokens=160",
           "rollout.group_size=4", "rollout.max_inflight_groups=2", "rollout.queue_size=4", "train.groups_per_step=2",
           "engine.max_num_seqs=8", "learner.micro_batch_tokens=256", "checkpoint.every=0",
           # a tiny model is never correct: a small KV penalty (traces differ in length, so in mean visible KV)
           # gives every group a reward spread, so the learner steps and reports its tokens
           "reward.kv_penalty.budget=8", "reward.kv_penalty.weight=0.01",
           # three steps at most: the deadline is a guard here, not the stop (see arm_seconds)
           "train.steps=3"),
    # arm_seconds: four Ray clusters start at once on 2 cores, and the first step ends 54-75 s after the start here
    # (2026-12-02); at 50 s (killed at 80) a slower CI machine killed ps-whole before its first step
    sft_examples=24, train_prompts=16, eval_problems=4, arm_seconds=100, eval_reserve_s=60, windows=(8, 32),
    parallel_evals=4, budget_s=1200)  # a shared 2-core machine: Ray and every eval process start slowly
TENTH_TASK = ("task.num_variables=3", "task.repeats=[8,10]", "task.num_registers=4", "task.lazy_registers=4")
TENTH = Scale(  # a tenth of the GPU run's trace on CPU (benchmarks/long_rl_pilot.py's task): ~270 tokens, W = 32
    window=32,
    sft=(*TENTH_TASK, "model.max_position_embeddings=1024", "learner.device=cpu", "learner.micro_batch_tokens=16384",
         "sft.steps=300", "sft.check_every=300"),
    train=(*TENTH_TASK, "engine.device=cpu", "learner.device=cpu", "rollout.num_gpus=0", "learner.num_gpus=0",
           "rollout.num_cpus=0.5", "learner.num_cpus=0.5", "ray.num_cpus=2", "sampling.max_tokens=320",
           "rollout.max_inflight_groups=4", "rollout.queue_size=8", "train.groups_per_step=4", "engine.max_num_seqs=32",
           "learner.micro_batch_tokens=4096", "checkpoint.every=0"),
    sft_examples=9600, train_prompts=256, eval_problems=64, arm_seconds=300, eval_reserve_s=240, windows=(16, 32, 64),
    parallel_evals=2, budget_s=2400)
SCALES = {"gpu": GPU, "smoke": SMOKE, "tenth": TENTH}
