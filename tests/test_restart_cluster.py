"""``sliderl train`` with a restart baseline as its rollout policy, on a real local Ray (2 CPUs): the summary mode's
restarts reach the Parquet trace log and the step metrics, and the learner scores each segment under its context."""

import json

import pytest
from cluster_jobs import model_dir, ray_session, tiny_job  # noqa: F401 (fixtures)

from sliderl.cluster.cli import main
from sliderl.cluster.storage.trace_log import TraceLog
from sliderl.core.trace import traces_from_table


def test_sync_summary_run_logs_restarts_and_trains_segments_exactly(ray_session, model_dir, tmp_path):  # noqa: F811
    from sliderl.cluster.run.driver import train

    # 16 tokens under summary:8:4: the call opens (forced) at the 4th generated token, closes (forced) at the 8th,
    # then the context is the prompt with the summary inserted; the tiny model's stop ids end some traces earlier
    cfg = tiny_job(model_dir, tmp_path / "run", "engine.kv=summary:8:4", "engine.summary_tool.json_call=false",
                   "train.mode=sync", "train.steps=2", "reward.cost_penalty={measure: kv_token_steps, budget: 10, "
                   "weight: 0.01}")
    result = train(cfg)
    traces = traces_from_table(TraceLog(result.run_dir).read())
    restarted = [t for t in traces if t.restarts]
    assert restarted and all(t.reencoded_tokens == sum(len(r.context_tail) for r in t.restarts) for t in traces)
    for t in restarted:
        for r in t.restarts:  # the summary goes into the prompt: the prompt's rest follows it, re-encoded
            rest = t.prompt_token_ids[r.kept_prompt:]
            assert r.forced and r.context_tail[len(r.context_tail) - len(rest):] == rest
        assert t.kv_token_steps > 0 and "cost_penalty" in t.reward_components
    rows = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(row["restarts"] > 0 and row["reencoded_tokens"] > 0 for row in rows)
    # sync: every trained trace was sampled with the weights the learner scores it with
    stepped = [row for row in rows if row["learner/stepped"]]
    assert stepped and all(row["learner/logprob_diff_max"] < 1e-4 for row in stepped)


@pytest.mark.parametrize("spec", ["last_k:4096:256", "summary:4096:256"])
def test_train_help_and_config_take_the_restart_policies(spec, capsys, tmp_path):
    assert main(["train", "--help"]) == 0
    help_text = capsys.readouterr().out
    assert "last_k:N:K" in help_text and "summary:N:S" in help_text and "summary_tool" in help_text
    cfg = tiny_job(tmp_path / "m", tmp_path / "run", f"engine.kv={spec}")
    assert cfg.engine.kv == spec
