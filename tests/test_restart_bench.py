"""The restart benchmarks' --smoke paths (benchmarks/restart_gpu.py, benchmarks/restart_compare.py): every row is
there and the restart counts are the ones the rules give."""

from benchmarks import restart_compare, restart_gpu


def test_restart_gpu_smoke_counts_the_restarts_the_rules_give(tmp_path):
    rows = {r["policy"]: r for r in restart_gpu.main(["--smoke", "--out", str(tmp_path)])}
    # 120 tokens each: last_k:48:8 restarts at 48 and 88 (128 is past the end), re-encoding 8 tokens each time;
    # summary:56:50 opens its 50-token call at the 6th token of each context (forced), so restarts at 56 and 112
    assert rows["prefix_sliding:48"]["restarts"] == 0
    assert rows["last_k:48:8"]["restarts"] == 2 and rows["last_k:48:8"]["reencoded_tokens"] == 16
    assert rows["summary:56:50"]["restarts"] == 2
    assert all(len(r["profile_ms"]) == -(-119 // r["profile_bin"]) and r["tok_per_s"] > 0 for r in rows.values())
    assert (tmp_path / "restart_gpu.md").read_text().count("\n") == 2 + 3


def test_restart_compare_smoke_writes_every_arm_evaluation_and_the_plot(tmp_path):
    rows = restart_compare.main(["--smoke", "--out", str(tmp_path)])
    modes = {"PS", "SW", "last_k", "summary"}
    assert {r["mode"] for r in rows if r["kind"] == "grpo"} == modes
    evals = {(r["model"], r["mode"]) for r in rows if r["kind"] == "eval"}
    assert {(f"{m}-trained", m) for m in modes} | {("warm-start", m) for m in modes} <= evals
    assert {("PS-trained", m) for m in modes} <= evals  # the training-free ablation (PS's own row included)
    summary_rows = [r for r in rows if r["kind"] == "eval" and r["mode"] == "summary"]
    assert all(r["restarts"] > 0 for r in summary_rows)
    assert (tmp_path / "pareto.png").is_file() and "Training-free" in (tmp_path / "summary.md").read_text()
