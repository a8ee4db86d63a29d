"""benchmarks/learner_gpu.py: its FLOP and token accounting against hand-computed values, and its --tiny run."""

import json
import shutil
import subprocess
import sys

import pytest
import torch

from benchmarks.learner_gpu import (
    PEAK_FLOPS,
    Shape,
    layer_params,
    learner_counts,
    make_traces,
    model_flops,
    rates,
    row_specs,
    visible_pairs,
)
from sliderl.core.kv_policy import KVPolicy
from sliderl.trainer.attention import PackedVisibility

TINY = Shape(layers=2, hidden=128, heads=4, kv_heads=2, head_dim=32, intermediate=256, vocab=261)  # --tiny's model


def test_model_flops_by_hand():
    s = Shape(layers=2, hidden=4, heads=2, kv_heads=1, head_dim=3, intermediate=5, vocab=8)
    # N = 2·(2·4·2·3 [q, o] + 2·4·1·3 [k, v] + 3·4·5 [MLP]) = 2·(48 + 24 + 60) = 264
    assert layer_params(s) == 264
    # 6·264·10 = 15840;  LM head 6·4·8·5 = 960;  attention 12·2·2·3·30 = 4320;  sum 21120
    assert model_flops(s, processed=10, scored=5, visible=30) == 21120


def test_layer_params_qwen3_1p7b():
    s = Shape(layers=28, hidden=2048, heads=16, kv_heads=8, head_dim=128, intermediate=6144, vocab=151936)
    # per layer: q, o 2·2048·2048 = 8,388,608; k, v 2·2048·1024 = 4,194,304; MLP 3·2048·6144 = 37,748,736
    # = 50,331,648; × 28 = 1,409,286,144 (the 1.41B that gives the 11.6% at 10,857 tok/s, 12.1 s)
    assert layer_params(s) == 1_409_286_144


def test_visible_pairs_by_hand_and_against_the_dense_mask():
    # P=2, T=4, prefix_sliding:2: positions 0..5; keys 2..5 die at position + 2.
    # queries 0..5 see {0}, {0,1}, {0,1,2}, {0,1,2,3}, {0,1,3,4}, {0,1,4,5}: 1+2+3+4+4+4 = 18 (causal: 21)
    death = KVPolicy.parse("prefix_sliding:2").death_positions(2, torch.zeros(6, dtype=torch.long))
    assert visible_pairs(torch.arange(6), death) == 18
    # a cut window (positions skip), against the dense mask of trainer.attention
    pos = torch.cat([torch.arange(5), torch.arange(40, 90)])
    death = KVPolicy.parse("prefix_sliding:7").death_positions(5, torch.zeros(90, dtype=torch.long))[pos]
    assert visible_pairs(pos, death) == int(PackedVisibility.pack([(pos, death)]).dense_mask().sum())


def test_learner_counts_of_the_tiny_truncated_row_by_hand():
    # P=16, T=512, W=64, k=4: targets the last 256, loss on the last 64; inputs = 16 prompt + 256.
    # visible per window: prompt queries 1+..+16 = 136; generated query j (0..255) sees 16 prompt keys
    # and min(j+1, 64) window keys: 16·256 + (1+..+64) + 192·64 = 4096 + 2080 + 12288 = 18464; 18600 in all
    counts = learner_counts(make_traces(16, 512, 64, 261), "truncated", 4)
    assert counts == dict(trained=8 * 64, processed=8 * 272, scored=8 * 256, visible=8 * 18600, largest_window=272)


def test_rates_by_hand():
    counts = dict(trained=512, processed=2176, scored=2048, visible=148800)
    # 6·294,912·2176 = 3,850,371,072;  6·128·261·2048 = 410,517,504;  12·2·4·32·148,800 = 457,113,600
    flops = 3_850_371_072 + 410_517_504 + 457_113_600  # = 4,718,002,176
    r = rates(TINY, counts, step_s=2.0)
    assert r["model_flops"] == flops
    assert r["mfu"] == pytest.approx(flops / (2.0 * 989e12))
    assert r["mfu_6n"] == pytest.approx(3_850_371_072 / (2.0 * 989e12))
    assert (r["tokens_per_s"], r["processed_per_s"]) == (256, 1088)


@pytest.mark.slow
def test_tiny_run_has_every_row_and_the_documented_numbers(tmp_path):
    name = "sliderl:truncated:ckpt:512"
    out = subprocess.run([sys.executable, "benchmarks/learner_gpu.py", "--tiny", "--out", str(tmp_path),
                          "--profile", name], capture_output=True, text=True, check=True, timeout=300)
    table = out.stdout.split("\nrow ")[1]
    expected = [s.name for s in row_specs([256, 512], 64, 4, peer=True)]
    assert len(expected) == 10  # T=256 <= k·W: no truncated row there
    for row_name in expected:
        assert any(line.startswith(row_name + " ") for line in table.splitlines()), (row_name, table)
    rows = {r["name"]: r for r in map(json.loads, (tmp_path / "rows.jsonl").read_text().splitlines())}
    assert sorted(rows) == sorted(expected) and all(r["status"] == "ok" for r in rows.values())
    r = rows[name]
    assert (r["trained"], r["processed"], r["scored"], r["visible"]) == (512, 2176, 2048, 148800)
    assert r["mfu"] == pytest.approx(4_718_002_176 / (r["step_s"] * PEAK_FLOPS))  # test_rates_by_hand's FLOPs
    assert r["tokens_per_s"] == pytest.approx(512 / r["step_s"])
    # the peer: 8 whole traces of 16 + 256 tokens, causal: 8·272·273/2 visible pairs; trains the 256 generated
    peer = rows["hf:full:ckpt:256"]
    assert (peer["trained"], peer["processed"], peer["scored"], peer["visible"]) == (2048, 2176, 2176, 8 * 37128)
    assert "profile of " + name in out.stdout and "gemm" in out.stdout
    assert json.loads((tmp_path / "profile.json").read_text())["profile"]["total_ms"] > 0


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_profile_counts_a_compiled_graph_s_kernels_once():
    # catches: inductor's "## Call CompiledFxGraph ... ##" ranges (user annotations on the GPU's timeline) summed
    # beside the kernels they span: the 7B whole-trace step's first profile (H100, a8d8fe3) gave 40.3 s of device
    # time for a 29.0 s step. Here a compiled chain runs 20 times; the kinds' total must not exceed the wall time
    # the step took on the GPU, and no annotation may appear among the top kernels
    from benchmarks.learner_gpu import profile_step

    chain = torch.compile(lambda x: (x.sin() * 2).cos() + x)
    x = torch.randn(1 << 24, device="cuda")
    chain(x)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def step():
        start.record()
        for _ in range(20):
            chain(x)
        end.record()

    prof = profile_step(step, vocab=7, cuda=True)
    assert not any(name.startswith("## ") for name, _ in prof["top_ms"]), prof["top_ms"]
    assert 0 < prof["total_ms"] <= start.elapsed_time(end) * 1.02, (prof["total_ms"], start.elapsed_time(end))


# ---------------------------------------------------------------------------- benchmarks/flex_attention.py


@pytest.mark.timeout(120)
def test_flex_attention_bench_counts_the_window_s_pairs_by_hand_and_names_a_bad_config(tmp_path):
    # catches: the TFLOP/s counted over the wrong pairs (the trace's T tokens instead of the learner's T - 1 inputs,
    # or every causal pair instead of the window's), heads and kv heads swapped in the rate, a config's options not
    # recorded in its row, and a malformed config reaching the GPU instead of exit 2 with its name.
    # By hand, --cpu-smoke (T 512, prompt 16, prefix_sliding:128, 4 query heads of D 16): the learner feeds the
    # 511 inputs; input i sees min(i + 1, 16 + 128) keys, so 144·145/2 + (511 - 144)·144 = 10,440 + 52,848 = 63,288
    run = lambda *configs: subprocess.run(  # noqa: E731
        [sys.executable, "benchmarks/flex_attention.py", "--cpu-smoke", "--out", str(tmp_path), "--configs",
         *configs], capture_output=True, text=True, timeout=100)
    out = run("default", "bwd_num_stages=2,BLOCK_M=64")
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()]
    assert [(r["config"], r["status"], r["visible_pairs"]) for r in rows] == [
        ("default", "ok", 63_288), ("bwd_num_stages=2,BLOCK_M=64", "ok", 63_288)]
    assert rows[0]["kernel_options"] is None and rows[1]["kernel_options"] == {"bwd_num_stages": 2, "BLOCK_M": 64}
    for r in rows:
        assert r["forward_tflops"] == pytest.approx(4 * 4 * 16 * 63_288 / r["forward_ms"] / 1e9)
        assert r["backward_tflops"] is None  # CPU: forward only
    assert rows[1]["max_abs_diff"] == 0.0  # eager on CPU: the options do not change the math
    bad = run("default", "bwd_num_stages=two")
    assert bad.returncode == 2 and "bwd_num_stages='two'" in bad.stderr, bad.stderr[-1000:]


# ---------------------------------------------------------------------------- benchmarks/long_rl.py


def _long_rl_traces(policy: str, prompt_len: int, generated: int) -> list:
    from sliderl.core.trace import Trace

    return [Trace(f"t{i}", "g0", "p0", 0, 0, policy, list(range(1, prompt_len + 1)), [7] * generated,
                  [-1.0] * generated, "length", reward=float(i)) for i in range(2)]  # rewards 0, 1: a signal


def test_long_rl_arms_put_the_loss_where_they_say(tiny_model_factory):
    # Catches an arm that trains another window than its name says (e.g. ps-whole's window_mode left at the
    # recipe's truncated, or sw with the whole trace): each arm's learner settings, resolved from
    # configs/long-rl.yaml as the benchmark resolves them, take one GRPO step on a group of 2 traces of
    # P = 10 prompt and T = 100 generated tokens under the arm's policy (W = 16, k = 4: T > k·W = 64).
    # Whole trace: 2·100 loss tokens and 2·(10 + 100 - 1) = 218 inputs. Truncated: the last k·W = 64 targets
    # with the loss on the last W = 16: 2·16 = 32 loss tokens, 2·(10 + 64) = 148 inputs.
    from benchmarks.long_rl import ARMS, RL_RECIPE
    from benchmarks.long_rl_scales import SMOKE
    from sliderl.cluster.config.base import load_config
    from sliderl.cluster.config.train import TrainConfig
    from sliderl.trainer.learner import Learner

    expected = {"ps-trunc": ("prefix_sliding:16", 32, 148), "ps-whole": ("prefix_sliding:16", 200, 218),
                "full": ("full", 200, 218), "sw": ("sliding_window:16", 32, 148)}
    assert SMOKE.window == 16 and [a.name for a in ARMS] == list(expected)
    model = tiny_model_factory("qwen3")
    for arm in ARMS:
        cfg = load_config(TrainConfig, str(RL_RECIPE), [*SMOKE.train, *arm.overrides(SMOKE.window)])
        policy, loss_tokens, inputs = expected[arm.name]
        assert cfg.engine.kv == policy, arm.name
        learner = Learner(str(model), cfg.learner_args())
        metrics = learner.step([_long_rl_traces(cfg.engine.kv, 10, 100)])
        assert (metrics.num_loss_tokens, metrics.num_tokens) == (loss_tokens, inputs), arm.name
        assert metrics.peak_memory_gib is None  # CPU: the learner reports CUDA memory only


def test_long_rl_arm_expects_its_next_step_without_the_start_up_and_keeps_weights_when_at_risk():
    # Catches the stop rule that stopped the H200's ps-whole arm after one step (2026-12-02): its first step took
    # 182 s from the arm's start, 86 s of it the learner's (compiles included), with 107 s to the deadline. Charging
    # the start-up again (expecting 182 s) stops it; expecting the learner's 86 s goes on. Since 182 s would not fit,
    # the weights are written first, so a kill after the deadline keeps them. Values by hand.
    from benchmarks.long_rl import step_decision

    assert step_decision([182.0], 86.0, 107.0, last=False) == (True, True)
    # later steps: the longest after the first (41 s) is expected; 137 s (the first) fits in 150 s: no write
    assert step_decision([137.0, 2.3, 41.0], 2.2, 150.0, last=False) == (True, False)
    # 41 s does not fit in 30 s: stop, writing the weights
    assert step_decision([137.0, 2.3, 41.0], 2.2, 30.0, last=False) == (False, True)
    # the recipe's last step: stop and write, however much time is left
    assert step_decision([137.0, 2.3], 2.2, 500.0, last=True) == (False, True)
    # a first step whose learner part alone would not fit: stop at once
    assert step_decision([182.0], 120.0, 107.0, last=False) == (False, True)


def _arm_run(folder, arms: dict[str, float], arm_seconds: float) -> None:
    """A finished long_rl.py run of ``arms`` (name -> the wall seconds of its final step), as run() leaves it:
    run.json with the arms' share of the GPU, and per arm curve.jsonl (two steps, the second trained) and
    final.json."""
    share = 1 / len(arms)
    for name, wall in arms.items():
        arm = folder / "arms" / name
        arm.mkdir(parents=True)
        rows = [{"step": 1, "wall_s": wall / 2, "accuracy": 0.25, "rollout_tokens_per_s": 100.0},
                {"step": 2, "wall_s": wall, "accuracy": 0.5, "rollout_tokens_per_s": 100.0, "learner/stepped": True,
                 "learner_step_seconds": 1.0, "learner/num_tokens": 40, "learner/num_traces": 4,
                 "learner/num_loss_tokens": 8}]
        (arm / "curve.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (arm / "final.json").write_text(json.dumps({"step": 2, "wall_s": wall}))
    evals = {f"end-{name}": {"label": f"end-{name}", "kv": "full", "accuracy": 0.5, "problems": 64} for name in arms}
    (folder / "run.json").write_text(json.dumps({
        "seconds": {"data": 1.0, "arms": arm_seconds}, "arm_seconds": arm_seconds, "evals": evals,
        "arms": {name: {"exit": 0, "gpu_busy_s": None, "share": share, "arm_seconds": arm_seconds} for name in arms}}))


def test_long_rl_merges_runs_of_different_arms_each_charged_its_own_share(tmp_path):
    # Catches a report of runs with --arms (one call per pair of arms, merged by --report-only --merge) that charges
    # every arm 1/4 of the GPU, or 1/len(all arms), instead of the share it had: ps-trunc and ps-whole ran together
    # (1/2 each), full alone (1/1). By hand: ps-trunc 100 s x 1/2 = 50 GPU-s, ps-whole 90 x 1/2 = 45, full 80 x 1 =
    # 80. Planting `share = 1 / len(arms)` in write_report gives 33, 30 and 27. Also: an arm in two runs is refused.
    from benchmarks.long_rl import ARMS, end_entries, start_entries
    from benchmarks.long_rl_scales import GPU

    _arm_run(tmp_path / "pair", {"ps-trunc": 100.0, "ps-whole": 90.0}, 110.0)
    _arm_run(tmp_path / "alone", {"full": 80.0}, 95.0)
    cmd = [sys.executable, "benchmarks/long_rl.py", "--report-only", "--out", str(tmp_path / "merged"), "--merge"]
    out = subprocess.run([*cmd, str(tmp_path / "pair"), str(tmp_path / "alone")], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    records = {r["arm"]: r for r in json.loads((tmp_path / "merged" / "summary.json").read_text())["arms"]}
    assert list(records) == ["ps-trunc", "ps-whole", "full"]  # sw did not run: no row for it
    assert {k: round(r["gpu_s"], 6) for k, r in records.items()} == {"ps-trunc": 50.0, "ps-whole": 45.0, "full": 80.0}
    assert (tmp_path / "merged" / "arms" / "full" / "curve.jsonl").is_file()
    twice = subprocess.run([*cmd[:3], "--out", str(tmp_path / "twice"), "--merge", str(tmp_path / "pair"),
                            str(tmp_path / "pair")], capture_output=True, text=True, timeout=300)
    assert twice.returncode == 2 and "ps-trunc, ps-whole ran in more than one of the runs" in twice.stderr
    assert not (tmp_path / "twice").exists()  # refused before anything was written
    # a run of some arms measures the starts of their policies only, and accuracy vs W only with ps-trunc's weights
    sw, whole = [a for a in ARMS if a.name == "sw"], [a for a in ARMS if a.name == "ps-whole"]
    assert [(e.label, e.kv) for e in start_entries(GPU, tmp_path, sw)] == [("start-sw", "sliding_window:512")]
    assert [(e.label, e.kv) for e in start_entries(GPU, tmp_path, whole)] == [("start-ps-trunc", "prefix_sliding:512")]
    (tmp_path / "arms" / "ps-whole" / "final").mkdir(parents=True)
    (tmp_path / "arms" / "ps-whole" / "final" / "config.json").write_text("{}")
    assert [e.label for e in end_entries(GPU, tmp_path, whole)] == ["end-ps-whole"]


def test_long_rl_verdict_ranks_the_gain_per_gpu_second_not_the_end_accuracy():
    # Catches a verdict that names the arm ending most accurate (the report did: a tenth-scale CPU run named ps-trunc
    # "trains best" after its accuracy fell 25% -> 20%, because sw ended at 0). By hand, 400 problems each: x ends
    # highest (0.60 -> 0.62, +2 pt in 50 GPU-s), y gains most (0.10 -> 0.50, +40 pt in 100 GPU-s = 0.4 pt per GPU-s);
    # y's noise 2·hypot(sqrt(.1·.9/400), sqrt(.5·.5/400)) = 5.8 pt < 40 and its lead 38 pt > hypot(5.8, 6.9) = 9.0.
    from benchmarks.long_rl_report import verdict

    def arm(name, start, end, gpu_s):
        return {"arm": name, "label": name, "start_accuracy": start, "end_accuracy": end, "gpu_s": gpu_s,
                "eval_problems": 400}

    text = verdict([arm("x", 0.60, 0.62, 50.0), arm("y", 0.10, 0.50, 100.0)])
    assert text.startswith("**Trains best per GPU-second: y**") and "more gain than x (beyond the noise)" in text
    assert "+40.0 pt, noise ±5.8" in text and "+0.400 pt per GPU-s" in text
    # an arm whose accuracy fell, beside one that stayed at 0: no winner
    text = verdict([arm("ps-trunc", 0.25, 0.203, 149.0), arm("sw", 0.0, 0.0, 149.0)])
    assert text.startswith("**No arm's greedy accuracy rose beyond the evaluations' noise**"), text


@pytest.mark.slow
@pytest.mark.timeout(2700)  # its own subprocess limits are longer than the suite's per-test timeout
def test_long_rl_smoke_run_has_every_arm_curve_and_window(tmp_path):
    # Catches a pipeline that drops an arm, an evaluation or the accuracy-vs-W rows, or evaluates under the wrong
    # policy: the whole benchmark at its CPU size (SFT, Ray arms at once, the batch of greedy evaluations). Two of the
    # four arms (one truncated, one whole-trace: every code path the others take; 63 s instead of 104 on 2 cores).
    # Independent check of the policies: an engine under prefix_sliding:W never shows a query more than the
    # prompt (< 40 tokens here) + W keys, under sliding_window:W at most W.
    # Run as on the GPU, in two calls: --sft-only, its light files copied elsewhere (as $OUT brings them back), then
    # --sft-from that copy. Also catches a copy that leaves out the checkpoint's weights, or --sft-from ignored (the
    # second call training an SFT of its own), or a weights-only copy whose manifest still lists the optimizer state
    # (every load of it would refuse it as damaged).
    bench = [sys.executable, "benchmarks/long_rl.py", "--smoke"]
    # (--arms on the first call too: it evaluates the start under those arms' policies only, one process fewer)
    first = subprocess.run([*bench, "--sft-only", "--arms", "ps-trunc", "full", "--out", str(tmp_path / "a"),
                            "--copy-to", str(tmp_path / "back")],
                           capture_output=True, text=True, timeout=900)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    # the arms start from the weights without the optimizer state (a third of the checkpoint: what fits a GPU call)
    carried = tmp_path / "back" / "sft" / "weights"
    assert (carried / "config.json").is_file() and list(carried.glob("*.safetensors"))
    assert (tmp_path / "back" / "sft" / "model" / "trainer_state.pt").is_file()
    assert not (carried / "trainer_state.pt").exists() and "trainer_state" not in (carried / "manifest.json").read_text()
    shutil.rmtree(tmp_path / "a")  # the second call sees only what came back
    # --start-evals reuses the first call's start rows only for the weights they measured: catches a check that
    # compares nothing (planted: the digest comparison dropped, this call runs and exits 0)
    record = json.loads((tmp_path / "back" / "run.json").read_text())
    other = tmp_path / "other.json"
    other.write_text(json.dumps({**record, "start_weights": {"model.safetensors": "0" * 64}}))
    refused = subprocess.run([*bench, "--sft-from", str(carried), "--start-evals", str(other), "--out",
                              str(tmp_path / "c")], capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "other weights than --sft-from" in refused.stderr, refused.stderr[-2000:]
    tmp_path = tmp_path / "b"
    out = subprocess.run([*bench, "--sft-from", str(carried), "--start-evals", str(carried.parents[1] / "run.json"),
                          "--arms", "ps-trunc", "full", "--out", str(tmp_path)], capture_output=True, text=True,
                         timeout=1500)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert not (tmp_path / "sft").exists() and not (tmp_path / "sft.log").exists()
    # the start rows are the first call's, not measured again (catches --start-evals ignored: planted, start-*
    # evaluations run in this call and their rows name this call's checkpoint)
    evals = json.loads((tmp_path / "run.json").read_text())["evals"]
    starts = {k: v for k, v in evals.items() if k.startswith("start")}
    assert starts == {k: record["evals"][k] for k in ("start-ps-trunc", "start-full")}  # the two arms' starts
    assert not list((tmp_path / "eval").glob("start-*"))
    assert f"path: {carried}" in (tmp_path / "arms" / "ps-trunc" / "train.yaml").read_text()
    summary = json.loads((tmp_path / "summary.json").read_text())
    records = {r["arm"]: r for r in summary["arms"]}
    assert list(records) == ["ps-trunc", "full"]
    for name, r in records.items():
        assert r["final"] and r["curve"] and r["steps"] >= 1, name
        assert r["start_accuracy"] is not None and r["end_accuracy"] is not None, name
    # the learner's counts against the driver's count of the traces' tokens, at steps where all 8 traces (2 groups
    # of 4) trained: whole trace, the loss on every generated token and P + T - 1 inputs each; truncated (W = 16,
    # k·W = 64), the loss on the last 16 of a trace longer than 64 (all of a shorter one): under the tokens
    checked = set()
    for name in records:
        for row in map(json.loads, (tmp_path / "arms" / name / "curve.jsonl").read_text().splitlines()):
            if row.get("learner/num_traces") != 8:
                continue
            loss, fed = row["learner/num_loss_tokens"], row["learner/num_tokens"]
            tokens, prompt = 8 * row["completion_tokens"], 8 * row["prompt_tokens"]
            if name in ("ps-whole", "full"):
                assert (loss, fed) == (tokens, prompt + tokens - 8), (name, row)
            else:
                assert loss < tokens and loss <= 8 * 64 and fed <= prompt + 8 * 64, (name, row)
            checked.add(name)
    assert checked == {"ps-trunc", "full"}, checked
    windows = {row["kv"]: row for row in summary["accuracy_vs_w"]}
    assert sorted(windows) == ["prefix_sliding:32", "prefix_sliding:8", "sliding_window:16"]
    for kv, row in windows.items():
        w = int(kv.split(":")[1])
        assert 0 < row["mean_live_kv"] <= (w if kv.startswith("sliding") else 40 + w), (kv, row)
    assert (tmp_path / "curves.png").stat().st_size > 10_000
    text = (tmp_path / "summary.md").read_text()
    assert "| ps-trunc | prefix_sliding:16 | truncated |" in text
    assert "Trains best per GPU-second" in text or "No arm's greedy accuracy rose beyond" in text


@pytest.mark.slow
@pytest.mark.timeout(1000)  # its own subprocess limits are longer than the suite's per-test timeout
def test_accuracy_vs_w_smoke_has_a_row_per_window_within_its_window(tiny_model_factory, tmp_path):
    # Catches an entry decoded under another policy than its row says (a window not passed through to the
    # engine): benchmarks/accuracy_vs_w.py --smoke on a random tiny model, each row's mean live KV within what the
    # policy allows — prompt (< 40 tokens) + W under prefix_sliding:W, W under sliding_window:W.
    model = tiny_model_factory("qwen3")
    out = subprocess.run([sys.executable, "benchmarks/accuracy_vs_w.py", str(model), "--smoke", "--parallel", "3",
                          "--out", str(tmp_path)], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = {r["kv"]: r for r in map(json.loads, (tmp_path / "accuracy_vs_w.jsonl").read_text().splitlines())}
    assert sorted(rows) == ["prefix_sliding:32", "prefix_sliding:8", "sliding_window:16"]
    for kv, row in rows.items():
        w = int(kv.split(":")[1])
        assert row["problems"] == 4 and row["tokens_per_second"] > 0, row
        assert 0 < row["mean_live_kv"] <= (w if kv.startswith("sliding") else 40 + w), (kv, row)
    assert "| prefix_sliding:8 |" in (tmp_path / "accuracy_vs_w.md").read_text()


def test_regress_flags_a_drop_beyond_the_tolerance_either_way_round():
    # catches: benchmarks/regress.py passing a regression — the batch-1 decode fell from 450 to 203 tok/s
    # and no check compared it with its record — a verdict read the wrong way round for lower-is-better
    # numbers (step seconds), or a missing measurement passing silently. By hand, tolerance 10%:
    # 450 -> 405 tok/s is 0.90 of the record (ok), 450 -> 203 is 0.45 (DROP); a step of 7.7 s that now takes
    # 9.0 s is 7.7/9.0 = 0.86 (DROP), one that now takes 6.5 s is 1.18 (better, beyond the tolerance).
    from benchmarks.regress import HEADLINES, Headline, main, value_of, verdict

    tok = Headline("t", "decode", {}, "tokens_per_s", "tok/s")
    step = Headline("s", "learner", {}, "step_s", "s", higher_is_better=False)
    assert verdict(tok, 450.0, 405.0, 0.10) == "ok"
    assert verdict(tok, 450.0, 203.0, 0.10) == "DROP"
    assert verdict(step, 7.7, 9.0, 0.10) == "DROP"
    assert verdict(step, 7.7, 6.5, 0.10) == "better"
    assert verdict(tok, None, 300.0, 0.10) == "new" and verdict(tok, 450.0, None, 0.10) == "missing"
    rows = [{"policy": "full", "position": 8192, "tokens_per_s": 1.0},
            {"policy": "prefix_sliding:4096", "position": 8192, "batch": 1, "tokens_per_s": 453.8}]
    batch1 = next(h for h in HEADLINES if h.id == "batch1.prefix_sliding.8k")
    assert value_of(batch1, rows) == 453.8  # the row whose fields all match, not the first row
    with pytest.raises(SystemExit):
        main(["--only", "no-such-headline"])


def test_regress_ratio_headlines_divide_by_their_own_runs_prefix_sliding_row():
    # catches a ratio headline (h2o or registers against prefix_sliding at equal live KV, issue 38 items 4-5) read as
    # the policy's own tok/s, inverted, or taken against another position's PS row, and a ratio whose PS row is
    # missing counted as a value. By hand from the H100 rows of d93e37f: h2o 5,241 / PS 5,725 = 0.9155 at 32K;
    # at 128K 5,220 / 5,722 = 0.9123.
    from benchmarks.regress import HEADLINES, value_of

    rows = [{"policy": "h2o:4096", "position": 32768, "tokens_per_s": 5241.0},
            {"policy": "prefix_sliding:4096", "position": 32768, "tokens_per_s": 5725.0},
            {"policy": "h2o:4096", "position": 131072, "tokens_per_s": 5220.0},
            {"policy": "prefix_sliding:4096", "position": 131072, "tokens_per_s": 5722.0}]
    by_id = {h.id: h for h in HEADLINES}
    assert value_of(by_id["h2o.vs_ps.32k"], rows) == pytest.approx(0.9155, abs=1e-4)
    assert value_of(by_id["h2o.vs_ps.128k"], rows) == pytest.approx(0.9123, abs=1e-4)
    assert value_of(by_id["h2o.vs_ps.128k"], rows[:3]) is None  # no PS row at 128K: missing, not a number


def test_regress_from_compares_the_rows_a_cut_short_run_left(tmp_path, capsys):
    # catches: --from re-running the scripts (on a CPU machine that would fail), reading a run's rows from the
    # wrong file, or a headline whose rows never came (batch1's script killed by the device call's limit)
    # counted as passing. The decode rows below are the H200's of 2026-12-04 (the PS 8K one: 7,782 tok/s
    # against the record's 7,964: 0.98, ok); the 32K one is planted at 5,000 (0.62 of 8,026: DROP).
    from benchmarks.regress import main

    rows = [{"policy": "prefix_sliding:4096", "position": 8192, "batch": 217, "tokens_per_s": 7782.0},
            {"policy": "prefix_sliding:4096", "position": 32768, "batch": 217, "tokens_per_s": 5000.0}]
    (tmp_path / "decode.json").write_text(json.dumps(rows))
    code = main(["--only", "decode.prefix_sliding.8k", "--from", str(tmp_path)])
    assert code == 0 and "regress:" not in capsys.readouterr().out.replace("regress: no rows", "")
    assert main(["--only", "decode.prefix_sliding.32k", "--from", str(tmp_path)]) == 1
    assert "DROP" in capsys.readouterr().out
    assert main(["--only", "batch1", "--from", str(tmp_path)]) == 1  # no batch1.json: missing, not ok
    out = capsys.readouterr().out
    assert "missing" in out and "no rows of batch1" in out
    # catches: rows from another card judged against an H200 record (the device lends H100s too: an H100's
    # decode is bound by its 3.35 TB/s, not the H200's 4.8) — the same planted 5,000 from an H100 is not a DROP
    # and does not fail the run (planted: the machine comparison dropped, DROP and exit 1)
    assert main(["--only", "decode.prefix_sliding.32k", "--from", str(tmp_path), "--machine", "1x H100"]) == 0
    assert "other card (recorded on 1x H200)" in capsys.readouterr().out


@pytest.mark.timeout(300)
def test_learner_memory_runs_and_truncation_caps_the_inputs():
    # catches benchmarks/learner_memory.py falling behind the Learner's API (it read StepMetrics as a dict and
    # died on its first row, unnoticed until its rows were wanted for docs/results.md) and a truncated window
    # that grows with T. By hand, P = 32, W = 32, k = 4: at T = 128 <= k·W the window is the whole trace,
    # P + T - 1 = 159 inputs (the last token is only a target); at T = 512 truncated feeds P + k·W = 160 and
    # full P + T - 1 = 543.
    out = subprocess.run([sys.executable, "benchmarks/learner_memory.py", "--lengths", "128", "512", "--window", "32",
                          "--hidden-size", "64", "--layers", "1"], capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {(line.split()[0], int(line.split()[1])): int(line.split()[2]) for line in out.stdout.splitlines()
            if line.split()[:1] in (["truncated"], ["full"])}
    assert rows == {("truncated", 128): 159, ("truncated", 512): 160, ("full", 128): 159, ("full", 512): 543}


def test_async_vs_sync_jobs_fit_the_two_cpus_it_starts_ray_with(tmp_path):
    # catches benchmarks/async_vs_sync.py's jobs asking a 2-CPU Ray instance for more CPUs than it has (the
    # default rollout.num_workers became 2, so learner 1 + 2 workers x 1 = 3 and both modes died before their
    # first step): the benchmark's own overrides, resolved, must reserve at most 2.
    import argparse

    from benchmarks.async_vs_sync import job_overrides

    from sliderl.cluster.config.base import load_config
    from sliderl.cluster.config.train import TrainConfig

    args = argparse.Namespace(max_tokens=48, steps=6, groups=4, group_size=4)
    for mode in ("sync", "async"):
        cfg = load_config(TrainConfig, None, job_overrides(args, tmp_path / "model", tmp_path / mode, mode))
        assert cfg.train.mode == mode
        cpus = cfg.learner.num_cpus * cfg.learner.num_ranks + cfg.rollout.num_cpus * cfg.rollout.num_workers
        assert cpus <= 2, (mode, cpus)


# ---------------------------------------------------------------------------- benchmarks/learner_scaling.py


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_learner_scaling_smoke_has_a_row_per_rank_count_at_the_same_global_batch(tmp_path):
    # catches: the benchmark's rank processes, its sync receiver or its rates failing on the CPU (the GPU batch
    # would then fail on the device instead), a global batch that shrinks with the ranks, where both rows must
    # feed the model 8 traces x 63 inputs = 504
    # per step (16 prompt + 48 generated tokens, each but the last an input: the Learner's num_tokens), a sync
    # never timed (sync_s missing or 0), and scaling not taken over the 1-rank row; group M's flags (partial
    # checkpointing, the model built outside the folder whose files come back) not reaching the rows; --profile (the
    # 7B whole-trace step's split by kind) not reaching the rank processes, its profile not written into the row, or
    # not printed
    out = subprocess.run([sys.executable, "benchmarks/learner_scaling.py", "--cpu-smoke", "--sync", "--out",
                          str(tmp_path / "out"), "--checkpoint-layers", "1", "--models", str(tmp_path / "models"),
                          "--profile"], capture_output=True, text=True, timeout=500)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert (tmp_path / "models/model-tiny/config.json").is_file() and not list((tmp_path / "out").glob("model-*"))
    rows = [json.loads(line) for line in (tmp_path / "out/results.jsonl").read_text().splitlines()]
    assert all(r["checkpoint_layers"] == 1 and r["masters"] for r in rows) and "masters ckpt:1" in out.stdout
    assert [(r["ranks"], r["seq"], r["status"]) for r in rows] == [(1, 64, "ok"), (2, 64, "ok")], rows
    for r in rows:
        assert r["num_tokens"] == 8 * 63 and r["tok_s"] == pytest.approx(504 / r["step_s"]) and r["sync_s"] > 0
        assert 0 < r["mfu"] < 1
        kinds = r["profile"]["kinds_ms"]
        assert "gemm" in kinds and sum(kinds.values()) == pytest.approx(r["profile"]["total_ms"])
        assert f"profile of tiny {r['ranks']} rank(s) T 64" in out.stdout
    assert rows[0]["scaling"] == 1.0 and rows[1]["scaling"] == pytest.approx(rows[1]["tok_s"] / rows[0]["tok_s"])


# ---------------------------------------------------------------------------- benchmarks/activation_memory.py


def test_activation_memory_of_an_eager_qwen3_1p7b_layer_by_hand():
    # catches: the count taking in the weights or another fixed-size buffer (bytes per token would then differ
    # between T = 32 and 64), a view's storage counted twice, FlexAttention's saves left out or double counted, and
    # a change to the eager layer that makes it keep more for backward. By hand, bytes a token (d = 2048 hidden,
    # I = 6144 MLP, Hq = 16 and Hkv = 8 heads of D = 128), from what each eager op saves:
    #   each of the two RMSNorms: its float32 input 4d, the float32 1/rms 4, two bf16 [d] products 2d + 2d
    #   q/k-norm: float32 q and k 4(Hq + Hkv)D, 1/rms 4(Hq + Hkv), the bf16 normed q and k 2(Hq + Hkv)D
    #   o_proj's input (the attention output) 2·Hq·D; the MLP: gate, up, silu(gate) and its product with up, 4 x 2I
    #   FlexAttention (added by the script): q, k, v 2(Hq + 2Hkv)D and the float32 log-sum-exp 4Hq
    from benchmarks.activation_memory import measure

    d, inter, hq, hkv, dh = 2048, 6144, 16, 8, 128
    by_hand = (2 * (8 * d + 4) + 6 * (hq + hkv) * dh + 4 * (hq + hkv) + 2 * hq * dh + 8 * inter
               + 2 * (hq + 2 * hkv) * dh + 4 * hq)
    assert by_hand == 112_808
    row = measure("1.7b", [32, 64], compiled=False)
    assert row["extra_bytes_per_token"] == [by_hand, by_hand]
    assert row["extra_gib_per_layer_at_window"] == pytest.approx(by_hand * 16_512 / 2**30)


def test_the_engine_benchmarks_kv_pool_fits_the_card():
    # Catches the engine benchmarks asking an H100 (79 GiB; the device lends H100s first) for the H200 rows' 100 GiB
    # KV pool — every engine row out of memory before its first step — and the card's bytes read as GB, not GiB.
    # By hand: an H200's 143,771 MiB = 140.4 GiB holds the ceiling, min(100, 123.4) = 100; an H100's 79.18 GiB
    # (what torch reported on 2026-12-05) gets 79.18 - 17 = 62.2; no GPU: the ceiling.
    from benchmarks.engine_gpu import kv_gb_for

    assert kv_gb_for(143771 * 2**20, 100.0) == 100.0
    assert kv_gb_for(int(79.18 * 2**30), 100.0) == 62.2
    assert kv_gb_for(None, 120.0) == 120.0


def test_the_byte_limit_reads_the_weights_once_a_step_and_each_rows_kv():
    # Catches the decode benchmark's byte limit (issue 38's "batch 1 at >= 70% of its limit", ">= 80% at batch
    # 2-8") charging the weights once per row instead of once per step, or leaving the KV out. By hand, the issue's
    # own numbers: weights 3.44 GB, prefix_sliding:4096 at 8K keeps 4,196 tokens x 114,688 B (2 x 28 layers x 8 KV
    # heads x 128 x 2 B) = 0.4812 GB a row, 4.25 TB/s: batch 1 -> 4.25e12 / 3.9212e9 = 1,083.8 tok/s; batch 8 ->
    # 8 x 4.25e12 / (3.44e9 + 8 x 0.4812e9) = 4,664 tok/s (with the weights charged per row it would stay 1,083.8).
    from benchmarks.engine_gpu import byte_limit

    kv_row = 4196 * 2 * 28 * 8 * 128 * 2
    assert byte_limit(3.44e9, kv_row, 1, 4.25e12) == pytest.approx(1083.8, abs=0.1)
    assert byte_limit(3.44e9, 8 * kv_row, 8, 4.25e12) == pytest.approx(4664, abs=1)
