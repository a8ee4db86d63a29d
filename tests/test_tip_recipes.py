"""The TIP recipes fit together: configs/tip-{sft,grpo,eval}.yaml (the CPU default) and
configs/tip-gpu-{sft,grpo,eval}.yaml (the GPU-scale variant), each loaded as its job loads it.

One task in the three stages, ``registers:N`` for the task's N registers, stage 2's warm start equal to
stage 1, a ``max_tokens`` that holds the longest reference trace (measured here by tokenizing the
task's solutions), and a comparison that reads a checkpoint stage 2 really writes.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from sliderl.cluster.config.base import load_config
from sliderl.cluster.config.sft import SFTJobConfig
from sliderl.cluster.config.train import TrainConfig
from sliderl.core.kv_policy import register_tokens
from sliderl.core.tiny import build_tokenizer

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
RECIPES = ["tip", "tip-gpu"]


def stages(recipe: str):
    """(stage 1, stage 2, the comparison) of ``recipe``, as ``sliderl sft / train / eval`` load them."""
    sft = load_config(SFTJobConfig, str(CONFIGS / f"{recipe}-sft.yaml"))
    grpo = load_config(TrainConfig, str(CONFIGS / f"{recipe}-grpo.yaml"))
    compare = load_config(TrainConfig, str(CONFIGS / f"{recipe}-eval.yaml"))
    return sft, grpo, compare


# Catches: the stages of one recipe drifting apart — stage 1 trained on the CPU default's shorter task
# while stage 2 or the comparison still generates the longer one, or registers:32 left beside a
# 12-register task (the annotations would never use <reg_12..31>, and the engine's register count would
# not be the one the model was trained under).
@pytest.mark.parametrize("recipe", RECIPES)
def test_one_task_and_one_register_count_across_the_stages(recipe):
    sft, grpo, compare = stages(recipe)
    task = sft.task.generator()
    assert grpo.task.generator() == task and compare.task.generator() == task
    spec = f"registers:{task.num_registers}"
    assert sft.kv == spec and grpo.engine.kv == spec
    tip = [e.kv for e in compare.eval.compare.entries if e.label.startswith("TIP")]
    assert tip == [spec, spec], tip


# Catches: `sliderl train configs/tip-grpo.yaml` warm-starting from another stage 1 than `sliderl sft
# configs/tip-sft.yaml` trains (another step count, learning rate, batch, model or data), so the guide's
# two ways to run stage 2 would start from different models.
@pytest.mark.parametrize("recipe", RECIPES)
def test_stage_two_warm_start_is_stage_one(recipe):
    sft, grpo, _ = stages(recipe)
    warm = grpo.warmstart
    assert warm.enabled and grpo.model == sft.model
    assert warm.sft == sft.sft and warm.learner == sft.learner
    assert (warm.data.source, warm.data.task_solution, warm.data.held_out) == \
        (sft.data.source, sft.data.task_solution, sft.data.held_out)


# Catches: sampling.max_tokens below the longest reference trace + eos: stage 2's rollouts and the
# comparison's samples of a correct long trace would be cut before their answer and scored wrong (the
# CPU task's longest register trace is 313 tokens; the GPU-scale task's 706).
@pytest.mark.parametrize("recipe", RECIPES)
def test_max_tokens_hold_the_longest_reference_trace(recipe):
    sft, grpo, compare = stages(recipe)
    task = sft.task.generator()
    tokenizer = build_tokenizer(tuple(register_tokens(task.num_registers)))
    longest = max(len(tokenizer(row[key], add_special_tokens=False).input_ids)
                  for row in task.problems(500) for key in ("solution", "solution_dense"))
    assert grpo.sampling.max_tokens >= longest + 1 and compare.sampling.max_tokens >= longest + 1, longest


# Catches: the comparison reading a stage-2 checkpoint that is never written — step_000060 left in the
# eval recipe after stage 2 moved to 25 steps, or a last step that is not a multiple of checkpoint.every.
@pytest.mark.parametrize("recipe", RECIPES)
def test_the_comparison_reads_stage_twos_last_checkpoint(recipe):
    _, grpo, compare = stages(recipe)
    tip = next(e for e in compare.eval.compare.entries if e.label == "TIP")
    assert grpo.train.steps % grpo.checkpoint.every == 0
    assert tip.checkpoint == f"runs/{recipe}-grpo/checkpoints/step_{grpo.train.steps:06d}"
