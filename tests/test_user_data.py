"""A user's own data (issue 15, scope 3): JSONL, JSON, Parquet files and folders with the user's column
names read through ``datasets``; SFT on a chat-messages file through the one trainer, its prompts the chat
template's; mistakes are one line and exit 2 before anything starts."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from transformers import AutoTokenizer

from sliderl.cluster.cli import main
from sliderl.cluster.config.base import load_config
from sliderl.cluster.config.train import TrainConfig
from sliderl.cluster.errors import ConfigError
from sliderl.cluster.records import Problem
from sliderl.cluster.storage.data import load_split

ROWS = [{"uid": f"u{i}", "question": f"What is {i} + {i}?", "final": str(2 * i), "level": i % 3} for i in range(6)]
COLUMNS = ["data.prompt_field=question", "data.answer_field=final", "data.id_field=uid"]
TINY = ["model.hidden_size=32", "model.num_layers=1", "model.num_heads=2", "model.num_kv_heads=1",
        "model.intermediate_size=64"]


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def write_parquet(path, rows) -> str:
    pq.write_table(pa.Table.from_pylist(rows), str(path))
    return str(path)


def problems_of(source: str, *overrides: str) -> list[Problem]:
    cfg = load_config(TrainConfig, None, ["task.type=math", "warmstart.enabled=false", f"data.source={source}", *COLUMNS,
                                          *overrides])
    return load_split(cfg, (cfg.data.source, cfg.data.split))


def test_jsonl_json_parquet_and_folders_load_to_the_same_problems(tmp_path):
    # Catches: a format or a folder read differently (rows lost or reordered, a folder's files not all
    # read), or the user's column names not reaching the loader. The reference is the rows as written.
    expected = [Problem(r["uid"], r["question"], r["final"]) for r in ROWS]
    (tmp_path / "jsonl-folder").mkdir()
    (tmp_path / "parquet-folder").mkdir()
    (tmp_path / "rows.json").write_text(json.dumps(ROWS))
    sources = {
        "jsonl": write_jsonl(tmp_path / "rows.jsonl", ROWS),
        "json": str(tmp_path / "rows.json"),
        "parquet": write_parquet(tmp_path / "rows.parquet", ROWS),
        "jsonl folder": (write_jsonl(tmp_path / "jsonl-folder" / "part-0.jsonl", ROWS[:4]),
                         write_jsonl(tmp_path / "jsonl-folder" / "part-1.jsonl", ROWS[4:]))[0].rpartition("/")[0],
        "parquet folder": (write_parquet(tmp_path / "parquet-folder" / "part-0.parquet", ROWS[:2]),
                           write_parquet(tmp_path / "parquet-folder" / "part-1.parquet", ROWS[2:]))[0].rpartition("/")[0],
    }
    for kind, source in sources.items():
        assert problems_of(source) == expected, kind


def test_a_wrong_column_names_itself_and_the_columns_the_file_has(tmp_path):
    # Catches: a misnamed column surfacing as a KeyError deep in the run, or an error that does not say
    # which columns exist. Parquet here: its schema, not the first row, lists the columns.
    source = write_parquet(tmp_path / "rows.parquet", ROWS)
    with pytest.raises(ConfigError, match=r"has no field 'problem'; its fields are uid, question, final, level"):
        problems_of(source, "data.prompt_field=problem")


def test_a_hub_name_offline_and_a_missing_file_are_clear_errors(tmp_path):
    # Catches: HF_HUB_OFFLINE=1 (set by the tests) turning a hub name into a traceback or a hang, and a
    # missing local file reported as a hub lookup.
    with pytest.raises(ConfigError, match=r"cannot load dataset 'someone/some-problems'.*HF_HUB_OFFLINE=0"):
        problems_of("someone/some-problems")
    with pytest.raises(ConfigError, match=r"data.source: dataset 'data/missing.parquet' does not exist"):
        problems_of("data/missing.parquet")


def conversations(n: int) -> list[dict]:
    """Two-turn chats 'count to NN' whose last answer is the two digits reversed; every other one has its own
    system message."""
    rows = []
    for i in range(n):
        turns = [{"role": "user", "content": "Hello."}, {"role": "assistant", "content": "Hi."},
                 {"role": "user", "content": f"flip {i:02d}"}, {"role": "assistant", "content": f"{i % 10}{i // 10}"}]
        system = [{"role": "system", "content": "Flip digits."}] if i % 2 else []
        rows.append({"messages": system + turns})
    return rows


def test_sft_on_a_chat_messages_file_trains_the_chat_templates_prompts(tmp_path):
    # Catches: a messages file read as prompt/completion pairs or rejected, the prompt built from other
    # messages than those before the last assistant message (or without the generation prompt, or encoded
    # again with special tokens), data.system_prompt ignored or overriding a conversation's own system
    # message, and the job not reaching the trainer (the loss must fall). Reference prompt ids:
    # transformers' apply_chat_template on the conversation's messages before the last one.
    from sliderl.cluster.config.prompts import prompt_format
    from sliderl.cluster.config.sft import SFTJobConfig
    from sliderl.cluster.run.sft_job import stage_examples
    from sliderl.trainer.sft import sft_trace

    rows = conversations(40)
    data, out = write_jsonl(tmp_path / "chats.jsonl", rows), tmp_path / "run"
    overrides = [*TINY, f"model.cache_dir={tmp_path / 'models'}", f"data.source={data}", "data.held_out=4",
                 "data.system_prompt=You flip digits.", "kv=full", "learner.lr=0.01", "learner.total_steps=40",
                 "sft.steps=40", "sft.batch_size=8", "sft.check_every=20", f"output_dir={out}"]
    assert main(["sft", *overrides]) == 0
    losses = json.loads((out / "model" / "sft.json").read_text())["result"]["losses"]
    assert sum(losses[-5:]) / 5 < 0.5 * losses[0], losses  # a random model starts near ln(259) = 5.6 nats
    assert yaml.safe_load((out / "config.yaml").read_text())["data"]["system_prompt"] == "You flip digits."

    cfg = load_config(SFTJobConfig, None, overrides)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.resolve(), local_files_only=True)
    prompts = prompt_format(cfg.data, cfg.model, tokenizer, conversations=True)
    train, held_out = stage_examples(cfg, cfg.task, prompts)
    assert len(train) == 36 and len(held_out) == 4
    for i, example in enumerate(train + held_out):
        messages = rows[i]["messages"]
        context = messages[:-1] if i % 2 else [{"role": "system", "content": "You flip digits."}, *messages[:-1]]
        expected = tokenizer.apply_chat_template(context, add_generation_prompt=True, tokenize=True,
                                                 return_dict=True)["input_ids"]
        trace = sft_trace(tokenizer, example, "full", i)  # what the trainer trains on
        assert trace.prompt_token_ids == list(expected)
        assert trace.completion_token_ids == tokenizer(messages[-1]["content"]).input_ids + [tokenizer.eos_token_id]


def test_sft_pairs_through_the_chat_template_and_bad_conversations(tmp_path, capsys):
    # Catches: plain prompt/completion pairs ignoring data.chat_template=true (trained raw while rollouts
    # are templated), and malformed conversations failing inside the trainer instead of naming the row.
    pairs = write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": f"say {i}", "completion": f"{i}"} for i in range(8)])
    base = ["sft", *TINY, f"model.cache_dir={tmp_path / 'models'}", "data.held_out=2", f"output_dir={tmp_path / 'run'}"]
    from sliderl.cluster.config.prompts import prompt_format
    from sliderl.cluster.config.sft import SFTJobConfig
    from sliderl.cluster.run.sft_job import stage_examples

    cfg = load_config(SFTJobConfig, None, base[1:] + [f"data.source={pairs}", "data.chat_template=true"])
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.resolve(), local_files_only=True)
    train, _ = stage_examples(cfg, cfg.task, prompt_format(cfg.data, cfg.model, tokenizer))
    instruction = "Please reason step by step, and put your final answer within \\boxed{}."
    assert list(train[0].prompt_token_ids) == tokenizer.apply_chat_template(
        [{"role": "user", "content": f"say 0\n\n{instruction}"}], add_generation_prompt=True, tokenize=True,
        return_dict=True)["input_ids"]

    capsys.readouterr()
    bad = conversations(8)
    bad[3]["messages"] = bad[3]["messages"][:-1]  # ends with the user's turn: no completion
    for rows, overrides, message in [
        (bad, [], "row 3: the last message is the completion and must be the assistant's, got role 'user'"),
        (conversations(8), ['data.template="{prompt}"'], "holds chat conversations, which need the chat template"),
    ]:
        source = write_jsonl(tmp_path / "chats.jsonl", rows)
        code = main([*base, f"data.source={source}", *overrides])
        err = capsys.readouterr().err
        assert code == 2 and message in err and err.count("\n") == 1, err
        assert not (tmp_path / "run").exists()


def test_data_mistakes_end_sliderl_before_ray_with_one_line(tmp_path, capsys):
    # Catches: a missing data file found only when the run reads it (after the run directory is written, or
    # inside an actor), and a chat-messages SFT file with raw prompts asked for failing with a traceback.
    import ray

    was_running = ray.is_initialized()
    cases = [
        (["train", "task.type=math", "warmstart.enabled=false", f"data.source={tmp_path / 'missing.jsonl'}"],
         "does not exist"),
        (["sft", f"data.source={tmp_path / 'missing'}/"], "does not exist"),
    ]
    for args, fragment in cases:
        code = main([*args, f"run_dir={tmp_path / 'run'}"] if args[0] == "train" else [*args, f"output_dir={tmp_path / 'run'}"])
        err = capsys.readouterr().err
        assert code == 2 and fragment in err and err.count("\n") == 1, err
        assert not (tmp_path / "run").exists()
    assert ray.is_initialized() == was_running
