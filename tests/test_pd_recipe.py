"""``sliderl train configs/planned-diffusion.yaml`` end to end on Ray, in a small setting: the warm start trains the
hybrid objective on span-annotated demonstrations, rollouts plan, execute their plans (spans denoised by the
runtime, committed, then the sum after the sync) and are scored by the verifier, the learner takes a rejection-
sampling step on them, and the model is evaluated after."""

from __future__ import annotations

from pathlib import Path

import pytest

from sliderl.core.loader import load_tokenizer
from sliderl.core.planned_diffusion import PDLayout, PDTokenIds

ROOT = Path(__file__).resolve().parents[1]


# catches: the recipe not loading or not reaching Ray's actors (an unknown key, a task type or algorithm the
# config rejects), the warm start training something the runtime cannot decode (a plan the runtime never
# executes: no rollout would hold a round), traces whose spans the learner cannot parse (their rounds are
# rebuilt here from the token ids and forced flags alone), rewards not reaching the learner.
@pytest.mark.slow
def test_the_recipe_warm_starts_plans_executes_and_evaluates(tmp_path):
    import ray

    from sliderl.cluster.actors.placement import start_local_ray
    from sliderl.cluster.config.base import load_config
    from sliderl.cluster.config.train import TrainConfig
    from sliderl.cluster.run.driver import train
    from sliderl.cluster.storage.trace_log import TraceLog

    run_dir = tmp_path / "run"
    overrides = [f"run_dir={run_dir}", f"warmstart.cache_dir={tmp_path / 'cache'}", "task.num_chains=[2,2]",
                 "task.num_steps=[1,2]", "task.train_size=64", "task.eval_size=4", "warmstart.data.held_out=4",
                 "warmstart.sft.steps=80", "warmstart.sft.batch_size=8", "warmstart.sft.check_every=80",
                 "warmstart.sft.log_every=0", "sampling.max_tokens=160", "sampling.temperature=0.3",
                 "eval.num_problems=4",
                 "eval.before=false", "train.steps=1", "train.groups_per_step=2", "rollout.group_size=2",
                 "rollout.num_cpus=0.5", "learner.num_cpus=0.5", "engine.num_blocks=512", "monitor.wandb.mode=disabled",
                 "monitor.include_dashboard=false", "monitor.plots=false"]
    owns = not ray.is_initialized()
    if owns:
        start_local_ray(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        result = train(load_config(TrainConfig, str(ROOT / "configs/planned-diffusion.yaml"), overrides))
    finally:
        if owns:
            ray.shutdown()
    assert result.state.step == 1
    traces = TraceLog(run_dir).read().to_pylist()
    assert traces and all(t["kv_policy"] == "planned_diffusion" for t in traces)
    tok = load_tokenizer(next(p for p in (tmp_path / "cache").iterdir() if p.is_dir()))
    tags = PDTokenIds.from_tokenizer(tok)
    rounds = [PDLayout.parse(len(t["prompt_token_ids"]), t["completion_token_ids"], tags, tok.decode,
                             t["forced"]).rounds for t in traces]
    executed = [r for rs in rounds for r in rs if r.sync is not None]
    assert executed and all(len(r.spans) == len(r.plan) for r in executed)
    assert all("correctness" in dict(t["reward_components"]) for t in traces)
    assert result.eval_after is not None and result.eval_after.kv_policy == "planned_diffusion"
    assert 0.0 <= result.eval_after.accuracy <= 1.0 and result.eval_after.num_problems == 4
