"""``sliderl generate`` end to end through ``sliderl.cluster.cli.main`` on a tiny local model."""

import json
from pathlib import Path

import pytest
import yaml

from sliderl.cluster.cli import main

WINDOW = 4
MAX_TOKENS = 16
PROMPTS = ["The capital of France is", "1 + 1 ="]


@pytest.fixture(scope="module")
def model_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="module")
def run(model_cache, tmp_path_factory):
    """One generate run: 2 prompts x 2 samples, 16 tokens each (eos ignored), Prefix Sliding W=4."""
    out = tmp_path_factory.mktemp("generate") / "out"
    code = main(["generate", f"model.cache_dir={model_cache}", f"output_dir={out}", f"engine.kv=prefix_sliding:{WINDOW}",
                 f"sampling.max_tokens={MAX_TOKENS}", "sampling.ignore_eos=true", "n=2", f"prompts={json.dumps(PROMPTS)}"])
    return code, out


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_generate_succeeds_and_saves_the_resolved_config(run, model_cache):
    code, out = run
    assert code == 0
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["engine"]["kv"] == f"prefix_sliding:{WINDOW}"
    assert saved["engine"]["block_size"] == 16  # a default, written out
    assert saved["sampling"]["max_tokens"] == MAX_TOKENS and saved["n"] == 2
    assert saved["model"]["cache_dir"] == str(model_cache)


def test_completions_hold_n_samples_per_prompt(run):
    records = read_jsonl(run[1] / "completions.jsonl")
    assert [(r["prompt_index"], r["sample_index"], r["prompt"]) for r in records] == [
        (0, 0, PROMPTS[0]), (0, 1, PROMPTS[0]), (1, 0, PROMPTS[1]), (1, 1, PROMPTS[1])]
    for r in records:
        # eos ignored, no stop strings: every request runs to max_tokens
        assert r["finish_reason"] == "length"
        assert r["num_tokens"] == len(r["token_ids"]) == len(r["logprobs"]) == MAX_TOKENS
        assert all(lp <= 0 for lp in r["logprobs"])


def test_completions_agree_with_the_hf_tokenizer(run, model_cache):
    from transformers import AutoTokenizer

    (model_dir,) = [p for p in model_cache.iterdir() if not p.name.startswith(".")]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    for r in read_jsonl(run[1] / "completions.jsonl"):
        assert r["prompt_token_ids"] == tokenizer(r["prompt"]).input_ids
        assert r["text"] == tokenizer.decode(r["token_ids"])


def test_kv_usage_follows_prefix_sliding(run):
    for r in read_jsonl(run[1] / "completions.jsonl"):
        prompt_len = len(r["prompt_token_ids"])
        # Token i (0-based) is sampled by the query at position P-1+i. The last one, at P+14, sees the
        # P prompt keys plus the W=4 keys P+11..P+14, so the peak is P+4; the first query (P-1) sees P.
        assert r["peak_visible_kv_tokens"] == prompt_len + WINDOW
        assert prompt_len < r["mean_visible_kv_tokens"] <= prompt_len + WINDOW


def test_summary_totals(run):
    summary = json.loads((run[1] / "summary.json").read_text())
    records = read_jsonl(run[1] / "completions.jsonl")
    assert summary["requests"] == 4
    assert summary["generated_tokens"] == 4 * MAX_TOKENS
    assert summary["peak_visible_kv_tokens"] == max(r["peak_visible_kv_tokens"] for r in records)
    assert summary["preemptions"] == 0
    assert summary["wall_seconds"] > 0


def test_config_file_and_hf_model_directory(model_cache, tmp_path, capsys):
    (model_dir,) = [p for p in model_cache.iterdir() if not p.name.startswith(".")]
    job = tmp_path / "job.yaml"
    job.write_text(f"model:\n  type: hf\n  path: {model_dir}\nengine:\n  kv: full\nprompts: [hello]\nn: 1\n")
    code = main(["generate", str(job), "sampling.max_tokens=3", "sampling.ignore_eos=true", f"output_dir={tmp_path / 'o'}"])
    assert code == 0
    (record,) = read_jsonl(tmp_path / "o" / "completions.jsonl")
    assert record["num_tokens"] == 3
    # full KV: the query producing token 3 (position P+1) sees all P+2 keys 0..P+1
    assert record["peak_visible_kv_tokens"] == len(record["prompt_token_ids"]) + 2
    printed = capsys.readouterr().out
    assert "kv: full" in printed and "generated tokens" in printed


@pytest.mark.parametrize("args, message", [
    (["engine.blok_size=3"], "unknown key 'blok_size' (did you mean 'block_size'?)"),
    (["engine.kv=prefix:3"], "unknown KV policy 'prefix'"),
    (["engine.block_size=abc"], "engine.block_size: Input should be a valid integer"),
    (["=3"], "malformed override '=3'"),
    (["missing.yaml"], "config file 'missing.yaml' not found"),
    (["a.yaml", "b.yaml"], "expected at most one config file"),
    (["model.type=hf", "model.path=/nonexistent/model"], "is not a Hugging Face model directory"),
])
def test_user_errors_print_one_line_and_exit_2(args, message, tmp_path, capsys):
    code = main(["generate", *args, f"output_dir={tmp_path / 'o'}"])
    err = capsys.readouterr().err
    assert code == 2
    assert message in err
    assert err.startswith("sliderl generate: error: ") and err.count("\n") == 1
    assert "Traceback" not in err


def test_usage_errors_exit_2(capsys):
    assert main([]) == 2
    assert main(["frobnicate"]) == 2
    assert "usage: sliderl" in capsys.readouterr().err


def test_help_with_a_config_lists_that_configs_values(capsys):
    """``sliderl train CONFIG --help`` lists CONFIG's values (and overrides given beside it), not the default
    recipe's. Catches: the help built from the default recipe whatever the command line names (the TIP recipe's
    engine.kv would then read prefix_sliding:24, tiny-arith's)."""
    repo = Path(__file__).resolve().parents[1]
    assert main(["train", str(repo / "configs/tip-grpo.yaml"), "--help"]) == 0
    assert "engine.kv = 'registers:12'" in capsys.readouterr().out
    assert main(["train", str(repo / "configs/tip-grpo.yaml"), "engine.kv=registers:16", "--help"]) == 0
    assert "engine.kv = 'registers:16'" in capsys.readouterr().out
    assert main(["train", "--help"]) == 0
    assert "engine.kv = 'prefix_sliding:24'" in capsys.readouterr().out  # the default recipe, configs/tiny-arith.yaml
