"""`sliderl sft` end to end through `sliderl.cluster.cli.main`: a user's file of prompt/completion pairs in, a
checkpoint out that the engine decodes; bad data is a one-line error before anything trains."""

import json

import pytest
import yaml

from sliderl.cluster.cli import main
from sliderl.rollout import LLM, SamplingParams

TINY = ["model.hidden_size=32", "model.num_layers=1", "model.num_heads=2", "model.num_kv_heads=1",
        "model.intermediate_size=64"]


def write_pairs(path, n: int) -> None:
    """Prompts 'say NN:' whose completion is the two digits reversed and a full stop."""
    rows = [{"question": f"say {i:02d}:", "reply": f" {i % 10}{i // 10}."} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_sft_job_trains_a_users_pairs_and_the_engine_decodes_them(tmp_path, capsys):
    # Catches: the job ignoring data.prompt_field/completion_field, training on the held-out rows, the
    # checkpoint not landing in output_dir/model, or the completion trained without eos (the engine
    # would then run on to max_tokens instead of stopping). The reference is the engine's own greedy
    # decoding of the saved checkpoint, not the trainer's numbers.
    data, out = tmp_path / "pairs.jsonl", tmp_path / "run"
    write_pairs(data, 100)
    code = main(["sft", *TINY, f"model.cache_dir={tmp_path / 'models'}", f"data.source={data}",
                 "data.prompt_field=question", "data.completion_field=reply", "data.held_out=4", "kv=full",
                 "learner.lr=0.01", "learner.total_steps=150", "sft.steps=150", "sft.batch_size=16",
                 "sft.check_every=50", "sft.log_every=0", f"output_dir={out}"])
    printed = capsys.readouterr().out
    assert code == 0
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["data"]["completion_field"] == "reply" and saved["kv"] == "full"
    record = json.loads((out / "model" / "sft.json").read_text())
    assert record["result"]["steps_run"] == 150 and [c[0] for c in record["result"]["checks"]] == [50, 100, 150]
    assert "held-out exact match" in printed
    llm = LLM(str(out / "model"))
    train_prompts = [f"say {i:02d}:" for i in range(0, 96, 7)]  # rows the job trained on
    outs = llm.generate(train_prompts, SamplingParams(max_tokens=8, temperature=0))
    right = sum(o.text == f" {i % 10}{i // 10}." and o.finish_reason == "stop"
                for i, o in zip(range(0, 96, 7), outs))
    assert right >= len(outs) - 2, [o.text for o in outs]  # learnt the mapping and stops after it


@pytest.mark.parametrize("overrides, message", [
    (["data.completion_field=answer"], "has no field 'answer'; its fields are question, reply"),
    (["data.held_out=100"], "has 100 rows; data.held_out=100 leaves none to train on"),
    (["learner.algo.type=grpo"], "learner: an SFT stage trains with algo type sft, got 'grpo'"),
    (["kv=prefix:3"], "unknown KV policy 'prefix'"),
])
def test_sft_job_user_errors_exit_2_with_one_line(overrides, message, tmp_path, capsys):
    # Catches: bad data or settings failing deep inside the training loop with a traceback, or after
    # the output directory was written.
    data = tmp_path / "pairs.jsonl"
    write_pairs(data, 100)
    out = tmp_path / "run"
    code = main(["sft", *TINY, f"model.cache_dir={tmp_path / 'models'}", f"data.source={data}",
                 "data.prompt_field=question", "data.completion_field=reply", f"output_dir={out}", *overrides])
    err = capsys.readouterr().err
    assert code == 2 and message in err and err.count("\n") == 1, err
    assert not (out / "model").exists()
