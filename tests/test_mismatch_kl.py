"""benchmarks/mismatch_kl.py: the whole trace reproduces the sampler, truncation is exact past the receptive
field and not before it, and the --tiny run writes every row and the plot.

The references are independent of the script: the engine's own sampler logprobs (paged KV cache,
incremental decode, CPU reference attention) and the receptive field of a 2-layer model worked out by hand.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import matplotlib.image
import pytest

from benchmarks.mismatch_kl import generate, main, measure, parse_args, prompts

ROOT = Path(__file__).resolve().parents[1]
W, T, N = 8, 128, 2  # T = 16·W generated tokens, N traces
P = 124  # tokens of a 26-step arithmetic prompt (tasks.arith) under the byte-level tokenizer
MODES = ["truncated k=1", "truncated k=2", "truncated k=4", "truncated k=8", "chunked k=4", "full", "full (last W)"]


@pytest.fixture(scope="module")
def rows(tiny_model_factory):
    """Every mode's row for N prefix_sliding:8 traces of the random 2-layer tiny Qwen3 (fp32, CPU)."""
    path = str(tiny_model_factory(arch="qwen3"))
    args = parse_args(["--model", "tiny", "--window", str(W), "--length", str(T), "--traces", str(N)])
    prompt_ids = prompts(path, N)
    assert [len(p) for p in prompt_ids] == [P] * N
    return {r["mode"]: r for r in measure(path, generate(path, prompt_ids, args), args)}


def test_whole_trace_recompute_reproduces_the_sampler(rows):
    # Catches a sampler/trainer visibility mismatch in the benchmark's recompute: deaths of another window
    # than the engine sampled under (prefix_sliding:W+1), positions shifted by one, the wrong temperature,
    # or sampler logprobs paired with the wrong tokens. Both sides run fp32, so only rounding differs:
    # ~1e-6 per logprob, k3 ~1e-12.
    full = rows["full"]
    assert full["loss_tokens"] == N * T and full["inputs_per_trace"] == P + T - 1
    assert full["kl"] < 1e-6 and full["max_abs"] < 1e-4
    assert rows["full (last W)"]["loss_tokens"] == N * W


def test_truncation_is_exact_past_the_receptive_field_and_cut_before_it(rows):
    # 2 layers of W = 8: a token's logits depend on the prompt and the last 2·(8 - 1) = 14 positions. A
    # truncated window feeds k·W generated positions, so its first loss token's predecessor has (k - 1)·W
    # fed positions before it: k = 4 and 8 (24, 56 >= 14) and chunked k=4 (24) are exact; k = 1 (0) cuts
    # its context. Catches the multiplier not reaching the windows (every row alike), the KL pooled over the
    # context targets rather than the last W (k=4 would include cut tokens), windows fed at renumbered
    # positions (Reset PE where the sampler used Continue PE), or the loss tokens scored twice.
    for k in (1, 2, 4, 8):
        r = rows[f"truncated k={k}"]
        assert r["loss_tokens"] == N * W and r["inputs_per_trace"] == P + k * W  # P + k·W targets' inputs
    for name in ("truncated k=4", "truncated k=8", "chunked k=4"):
        assert rows[name]["max_abs"] < 1e-4, (name, rows[name])
    assert rows["chunked k=4"]["loss_tokens"] == N * T  # every token once
    cut = rows["truncated k=1"]
    assert cut["max_abs"] > 1e-2 and cut["kl"] > 1e3 * rows["truncated k=8"]["kl"]


@pytest.mark.slow
def test_tiny_run_writes_every_row_and_the_plot(tmp_path):
    # Catches the command line path breaking (arguments, the engine -> trainer hand-off, rows.jsonl, the
    # PNG) and rows dropped, renamed or counting other loss tokens than their mode's; --plot redraws rows.
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "mismatch_kl.py"), "--tiny", "--out", str(tmp_path)],
                   check=True, capture_output=True, text=True, timeout=300)
    rows = [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()]
    assert [r["mode"] for r in rows] == MODES
    w, t = 4, 64  # --tiny: W=4, T=64, 2 traces
    assert [r["loss_tokens"] for r in rows] == [2 * w] * 4 + [2 * t, 2 * t, 2 * w]
    assert all(r["kl"] >= 0 and len(r["kl_per_trace"]) == 2 for r in rows)
    assert matplotlib.image.imread(tmp_path / "mismatch_kl.png").shape[:2] == (420, 1150)  # ours beside the paper's panel
    main(["--plot", str(tmp_path / "rows.jsonl"), str(tmp_path / "rows.jsonl"), "--out", str(tmp_path / "both")])
    assert (tmp_path / "both" / "mismatch_kl.png").stat().st_size > 10_000


def test_model_path_measures_that_model_and_refuses_a_folder_without_one(tiny_model_factory, tmp_path, capsys):
    # Catches (issue 41) --model-path being ignored (the script measuring its own SFT model instead) or a typo'd
    # path failing deep inside the loader: the path is what build_model returns, and a folder without config.json
    # is a usage error (exit 2) naming the path.
    from benchmarks.mismatch_kl import build_model

    path = tiny_model_factory(arch="qwen3")
    args = parse_args(["--model-path", str(path), "--task-steps", "8", "12"])
    assert build_model(args, tmp_path) == str(path) and args.model == f"path:{path}"
    assert all(8 <= len(r["prompt"].split("Apply ")[1].split()) <= 12 for r in args.task.problems(20, "eval"))
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--model-path", str(tmp_path / "nowhere")])
    assert exit_info.value.code == 2 and "nowhere" in capsys.readouterr().err
