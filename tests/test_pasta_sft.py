"""A Pasta-SFT stage (trainer.sft with kv='pasta') on the summed-chains task: it runs end to end from a
base model without the Pasta-Lang tags, and the loss falls."""

from __future__ import annotations

from sliderl.core.loader import load_tokenizer
from sliderl.core.pasta import PASTA_TOKENS
from sliderl.tasks.pasta import PastaTask
from sliderl.trainer.algorithms import SFTOptions
from sliderl.trainer.learner_args import LearnerArgs
from sliderl.trainer.sft import SFTArgs, SFTExample, run_sft

TINY = dict(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64)


# catches: a pasta stage that cannot run from a base model (planted: bind_policy_vocab not adding the
# tags -> the Learner cannot find them), or one whose pasta traces carry no loss (planted:
# PastaLayout.target_mask all False -> nothing is stepped and the loss stays 0).
def test_pasta_sft_stage_runs_and_the_loss_falls(tmp_path):
    from sliderl.core.tiny import make_tiny_model

    base = make_tiny_model(tmp_path / "base", **TINY)
    task = PastaTask(num_chains=(2, 2), num_steps=(8, 8))
    train = [SFTExample(p["prompt"], p["solution"]) for p in task.problems(20)]
    args = LearnerArgs(algo=SFTOptions(), lr=1e-2, adam_betas=(0.9, 0.98), window_mode="full")
    result = run_sft(base, tmp_path / "sft", train, [], "pasta", args, SFTArgs(steps=12, batch_size=5))
    vocab = load_tokenizer(result.path).get_vocab()
    assert all(tag in vocab for tag in PASTA_TOKENS)  # the checkpoint's tokenizer has the tags
    # a random model starts near ln(vocab) = ln(264) = 5.6 nats per token; 12 steps learn the format
    assert result.losses[0] > 4.0
    assert sum(result.losses[-3:]) / 3 < 0.6 * result.losses[0]


# catches: the recipes (configs/pasta-sft.yaml as it is, and with kv=full data.task_solution=solution_plain)
# not reaching a stage — task.type=pasta not a generated task, so the job refuses data.source=task (planted:
# "pasta" dropped from GENERATED_TASKS) — or Pasta-SFT not trained under kv=pasta (its checkpoint then
# lacks the tags; the baseline's must not have them).
def test_pasta_sft_and_baseline_sft_jobs_run_from_the_recipe(tmp_path):
    import json
    from pathlib import Path

    from sliderl.cluster.cli import main

    recipe = str(Path(__file__).resolve().parents[1] / "configs/pasta-sft.yaml")
    quick = ["sft.steps=2", "sft.check_every=2", "data.held_out=2", "model.hidden_size=32", "model.num_layers=1",
             "model.num_heads=2", "model.num_kv_heads=1", "model.intermediate_size=64"]
    assert main(["sft", recipe, f"output_dir={tmp_path / 'pasta'}", *quick]) == 0
    assert main(["sft", recipe, "kv=full", "data.task_solution=solution_plain", f"output_dir={tmp_path / 'base'}",
                 *quick]) == 0
    pasta_vocab = json.loads((tmp_path / "pasta/model/tokenizer.json").read_text())["added_tokens"]
    base_vocab = json.loads((tmp_path / "base/model/tokenizer.json").read_text())["added_tokens"]
    assert {t["content"] for t in pasta_vocab} >= set(PASTA_TOKENS)  # kv=pasta bound the tags
    assert not {t["content"] for t in base_vocab} & set(PASTA_TOKENS)  # Baseline-SFT: plain text, full
