"""The GPU recipes (configs/qwen3-math-*.yaml), the checkpoint they are benchmarked on
(benchmarks/make_checkpoint.py), and the CPU runs of benchmarks/colocate.py and benchmarks/trl_peer.py."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import tarfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from benchmarks.colocate import DATA_CANDIDATES, step_numbers, table
from benchmarks.make_checkpoint import SIZES, make_checkpoint, stop_ids
from sliderl.cluster.cli import main as cli
from sliderl.cluster.config.base import load_config
from sliderl.cluster.config.train import TrainConfig

ROOT = Path(__file__).resolve().parents[1]
RECIPES = {"1gpu": ROOT / "configs/qwen3-math-1gpu.yaml", "ngpu": ROOT / "configs/qwen3-math-ngpu.yaml"}
MATH500 = next((p for p in DATA_CANDIDATES if p.is_file()), DATA_CANDIDATES[-1])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "qwen3-tiny", "tiny", extra_stop_ids=8, device="cpu")


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_a_recipe_loads_and_keeps_the_papers_training_settings(name, checkpoint, capsys):
    # catches: a recipe that no longer loads (a misspelt or removed key, a value out of range), and one that
    # quietly lost what it promises: Prefix Sliding rollouts to 8K, truncated windows with k=4, budget forcing
    # inside max_tokens, bf16 with float32 masters, checkpointing, the chat template, math_verify, the GPU
    # placement (1gpu: both actors on one GPU, CUDA IPC, async; ngpu: a GPU each, NCCL, async), an engine
    # too small to run every rollout in flight at once (planted: the 1gpu recipe's old max_num_seqs 64 beside
    # 16 groups x 8 in flight fails), and that `full` is one override away
    cfg = load_config(TrainConfig, str(RECIPES[name]), [f"model.path={checkpoint}"])
    assert (cfg.task.type, cfg.engine.kv, cfg.sampling.max_tokens) == ("math", "prefix_sliding:1024", 8192)
    assert (cfg.learner.window_mode, cfg.learner.multiplier, cfg.learner.gradient_checkpointing) == ("truncated", 4, True)
    assert cfg.sampling.max_thinking_tokens < cfg.sampling.max_tokens and cfg.data.chat_template is True
    assert (cfg.engine.device, cfg.engine.dtype, cfg.learner.device, cfg.learner.dtype) == ("cuda", "bfloat16", "cuda", "bfloat16")
    assert cfg.learner.master_weights and cfg.reward.correctness.weight == 1.0 and not cfg.warmstart.enabled
    if name == "1gpu":
        assert cfg.rollout.num_workers * cfg.rollout.num_gpus + cfg.learner.num_gpus <= 1
        assert (cfg.weight_sync.backend, cfg.train.mode, cfg.train.max_staleness) == ("cuda_ipc", "async", 2)
    else:
        assert (cfg.rollout.num_gpus, cfg.learner.num_gpus, cfg.weight_sync.backend) == (1, 1, "broadcast")
        assert cfg.weight_sync.broadcast_backend == "nccl" and cfg.train.mode == "async"
    assert cfg.engine.max_num_seqs >= cfg.rollout.max_inflight_groups * cfg.rollout.group_size
    assert load_config(TrainConfig, str(RECIPES[name]), [f"model.path={checkpoint}", "engine.kv=full"]).engine.kv == "full"
    # and the recipe keeps what it generates: the N-GPU recipe had 32 groups in flight at 8 per step under
    # max_staleness 1, so a group arrived ~4 versions old and most were dropped (stale_drop_warning, below)
    assert cfg.stale_drop_warning() is None
    assert cli(["train", str(RECIPES[name]), f"model.path={checkpoint}", "--help"]) == 0
    assert "engine.kv = 'prefix_sliding:1024'" in capsys.readouterr().out


def test_async_runs_warn_when_more_groups_are_in_flight_than_staleness_can_train(checkpoint):
    # catches: an async config that generates groups only to drop them as stale. A group arrives about
    # (workers x max_inflight_groups) / groups_per_step versions old; on the CPU (colocate.py --cpu-smoke, 2 groups
    # per step, max_staleness 1) 4 x G in flight dropped 13 of 25 arrived groups, G dropped 1 of 17. By hand:
    #   1 x 32 in flight, G=8,  s=1: 32 > 1 x 8  -> warn, "about 4 versions old", the fit is 8 per worker
    #   1 x 16 in flight, G=8,  s=1: 16 > 8      -> warn (planted: (s + 1) x G = 16 as the limit stays silent)
    #   2 x 5  in flight, G=8,  s=1: 10 > 8      -> warn (planted: one worker's 5 as the in-flight count stays silent)
    #   1 x 32 in flight, G=16, s=2: 32 <= 32    -> silent (the N-GPU recipe now); sync mode: silent
    #   1 x 8  in flight, G=8,  s=0: 8 <= 1 x 8  -> silent (one step's worth always fits), 1 x 9 -> warn
    def warning(workers, inflight, groups, staleness, mode="async"):
        return load_config(TrainConfig, str(RECIPES["ngpu"]), [
            f"model.path={checkpoint}", f"rollout.num_workers={workers}", f"rollout.max_inflight_groups={inflight}",
            f"train.groups_per_step={groups}", f"train.max_staleness={staleness}", f"train.mode={mode}",
            "weight_sync.backend=object_store"]).stale_drop_warning()

    old = warning(1, 32, 8, 1)
    assert "32 groups in flight" in old and "about 4 versions old" in old and "rollout.max_inflight_groups=8)" in old
    assert warning(1, 16, 8, 1) is not None and warning(2, 5, 8, 1) is not None
    assert warning(1, 32, 16, 2) is None and warning(1, 32, 8, 1, mode="sync") is None
    assert warning(1, 8, 8, 0) is None and "<= max(max_staleness, 1) x groups_per_step = 8" in warning(1, 9, 8, 0)


@pytest.mark.skipif(not MATH500.is_file(), reason="needs ../shared/data/math500-dev.jsonl")
def test_the_recipe_reads_the_math_file_through_the_chat_template(checkpoint, tmp_path):
    # catches: recipe column names that are not the MATH file's (problem/answer/id), an eval split the file
    # does not have, and prompts that do not go through the checkpoint's chat template (the engine must get
    # exactly apply_chat_template([user: problem + blank line + instruction]) with the generation prompt)
    from transformers import AutoTokenizer

    from sliderl.cluster.config.prompts import BOXED_INSTRUCTION
    from sliderl.cluster.run.plan import prepare

    cpu = ["engine.device=cpu", "learner.device=cpu", "rollout.num_gpus=0", "learner.num_gpus=0",
           "weight_sync.backend=object_store", "engine.dtype=float32", "learner.dtype=float32"]
    cfg = load_config(TrainConfig, str(RECIPES["1gpu"]), [f"model.path={checkpoint}", f"data.source={MATH500}",
                                                           f"run_dir={tmp_path / 'run'}", *cpu])
    plan = prepare(cfg)
    rows = [json.loads(line) for line in MATH500.read_text().splitlines()]
    assert len(plan.train_problems) == len(rows) and len(plan.eval_problems) == cfg.eval.num_problems
    first = next(p for p in plan.train_problems if p.prompt_id == rows[0]["id"])
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    expected = tokenizer.apply_chat_template([{"role": "user", "content": f"{rows[0]['problem']}\n\n{BOXED_INSTRUCTION}"}],
                                             add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    assert list(first.prompt_token_ids) == list(expected) and first.answer == rows[0]["answer"]


def test_the_checkpoint_is_qwen3_shaped_and_both_engines_stop_on_its_extra_end_ids(checkpoint):
    # catches: shapes that drift from Qwen3's published configs (0.6B: 1024 wide, MLP 3072; 1.7B: 2048, 6144;
    # both 28 layers, 16/8 heads of 128, 151,936 ids, tied), a chat template without Qwen3's empty think
    # block for enable_thinking=false, and extra end ids that sliderl's engine or transformers' generate
    # (TRL's sampler) ignore: every completion that ended early must end on one of them
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sliderl.core.tiny import QWEN3_1P7B
    from sliderl.rollout import LLM, SamplingParams

    common = dict(num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936)
    assert SIZES["0.6b"] | common == SIZES["0.6b"] and (SIZES["0.6b"]["hidden_size"], SIZES["0.6b"]["intermediate_size"]) == (1024, 3072)
    assert all(SIZES["1.7b"][k] == v for k, v in QWEN3_1P7B.items() if k != "eos_token_id")
    # 150 ids over [1000, 151936): 1000 + i * 150936 // 150; the last is 1000 + 149 * 150936 // 150 = 150929
    ids = stop_ids(151936, 150)
    assert (len(ids), ids[0], ids[1], ids[-1]) == (150, 1000, 2006, 150929)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "1+1?"}], add_generation_prompt=True,
                                         tokenize=False, enable_thinking=False)
    assert text == "<|im_start|>user\n1+1?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    ends = set(json.loads((checkpoint / "generation_config.json").read_text())["eos_token_id"])
    assert ends == {258, 256, *stop_ids(261, 8)}
    prompt = tokenizer(text).input_ids
    outs = LLM(str(checkpoint), kv="prefix_sliding:16", num_blocks=256).generate(
        [prompt] * 16, [SamplingParams(max_tokens=48, seed=s) for s in range(16)])
    extra = ends - {256, 258}
    early = [o.token_ids for o in outs if len(o.token_ids) < 48]
    assert all(t[-1] in ends for t in early) and any(t[-1] in extra for t in early)
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    torch.manual_seed(0)
    out = hf.generate(torch.tensor([prompt] * 16), do_sample=True, max_new_tokens=48)[:, len(prompt):].tolist()
    firsts = [next((i for i, t in enumerate(row) if t in ends), None) for row in out]
    assert any(i is not None and i < 47 and row[i] in extra for i, row in zip(firsts, out))
    assert all(set(row[i + 1:]) <= {256} for i, row in zip(firsts, out) if i is not None)  # stopped there: pads after


def test_step_numbers_by_hand():
    # catches: a wrong step time (not the difference of consecutive elapsed_s), warm-up steps counted, and a
    # generation time that forgets the learner, the sync or the release. Steps at elapsed 10, 16, 23, 28:
    # the timed steps (after 1 warm-up) take 6, 7, 5 s -> median 6; learner 2, 3, 2 -> 2; sync 0.5 each;
    # release 1, 1, 1 -> 1; gen = 6 - 2 - 0.5 - 1 = 2.5; tokens per step = 100 x 2 groups x 4 = 800 (median
    # of 100, 120, 90 = 100); rollout tok/s per GPU = 800 / 2.5 = 320; learner tok/s = median(50/2, 60/3, 40/2) = 20
    rows = [dict(elapsed_s=e, learner_step_seconds=ls, weight_sync_seconds=0.5, memory_release_seconds=1.0,
                 completion_tokens=c, rollout_tokens_per_s=0.0, reward=0.0, **{"learner/num_loss_tokens": n})
            for e, ls, c, n in ((10, 9, 50, 30), (16, 2, 100, 50), (23, 3, 120, 60), (28, 2, 90, 40))]
    args = SimpleNamespace(warmup=1, groups=2, group_size=4, rollout_gpus=1.0)
    got = step_numbers(args, rows, sync_mode=True)
    assert (got["timed_steps"], got["step_s"], got["learner_s"], got["sync_s"], got["release_s"]) == (3, 6, 2, 0.5, 1.0)
    assert got["gen_s"] == pytest.approx(2.5) and got["tokens_per_step"] == 800
    assert got["rollout_tok_s_per_gpu"] == pytest.approx(320) and got["learner_tok_s"] == pytest.approx(20)
    assert got["pace_s"] == got["step_mean_s"] == pytest.approx(6)  # sync: (6 + 7 + 5) / 3


def test_async_step_numbers_and_their_table_row_by_hand():
    # catches: the N-GPU recipe's (async) run crashing colocate.py's table on its gen_s None — found on the CPU on
    # 2026-12-02 (`colocate.py --cpu-smoke --config configs/qwen3-math-ngpu.yaml --modes as-is`): the first run's
    # row killed the script before the second policy ran. Async: no gen_s, one rollout GPU; steps at elapsed
    # 10, 14, 19, 28 -> timed 4, 5, 9 (median 5)
    rows = [dict(elapsed_s=e, learner_step_seconds=1.0, weight_sync_seconds=0.1, completion_tokens=10,
                 rollout_tokens_per_s=r, reward=0.0, stale_groups_dropped=d)
            for e, r, d in ((10.0, 100.0, 7), (14.0, 300.0, 0), (19.0, 500.0, 4), (28.0, 400.0, 0))]
    args = SimpleNamespace(warmup=1, groups=2, group_size=4, rollout_gpus=1.0)
    got = step_numbers(args, rows, sync_mode=False)
    # also catches: an async run's pace and rate read off the median step (the H200 run of 2026-12-03 alternated
    # 8.6 and 64 s steps: median 56.9, mean 41.0) -- the rate is the tokens that arrived in the timed steps over
    # their seconds, (300 x 4 + 500 x 5 + 400 x 9) / 18 = 7300 / 18 = 405.56 (the median rate 400, the plain mean
    # 400 too), the mean step (4 + 5 + 9) / 3 = 6 (the median 5), the drops of the timed steps 0 + 4 + 0 = 4 (not
    # the warm-up's 7); planted: the median rate back (400), the median as the mean (5), drops from step 0 (11)
    assert got["gen_s"] is None and got["step_s"] == 5 and got["step_mean_s"] == pytest.approx(6)
    assert got["rollout_tok_s_per_gpu"] == pytest.approx(7300 / 18) and got["stale_dropped"] == 4
    # and the pace: 10 tokens x 2 groups x 4 = 80 tokens per timed step at 7300 / 18 tok/s = 80 x 18 / 7300 = 0.197 s
    # (planted: the trained tokens' own rate, 240 / 18 s, gives 6 s, the mean step again)
    assert got["pace_s"] == pytest.approx(80 * 18 / 7300)
    line = table([{"run": "as-is:full", "status": "ok", **got}]).splitlines()[1]
    assert line.split()[:6] == ["as-is:full", "ok", "5.00", "6.00", "0.20", "-"]


def test_colocate_modes_pin_the_train_mode_they_measure(checkpoint):
    # catches: a benchmark mode that silently takes the recipe's own train.mode (the 1-GPU recipe went async on
    # 2026-12-03: its "keep" rows, and TRL's peer row beside them, are sync measurements, and "release" is refused
    # outside sync), and an async mode whose staleness cannot train what it keeps in flight. By hand, 4 groups of 8:
    #   keep, release: sync, max_inflight_groups 4 (= groups), 32 sequences
    #   async: max_staleness 2, 2 x 4 = 8 groups in flight and queued, 8 x 8 = 64 sequences, no staleness warning
    #   a --set after the mode's own overrides still wins (the 2026-12-03 runs passed train.mode=async to keep)
    #   as-is, the N-GPU recipe (32 in flight and queued at 16 per step: 2 per group of a step): its own async mode
    #     and pool, 2 x 4 = 8 in flight and queued, 64 sequences (planted: in flight = groups, 4, as before)
    from benchmarks.colocate import overrides

    args = SimpleNamespace(groups=4, group_size=8, warmup=1, steps=5, model=checkpoint, data=MATH500, max_tokens=8192,
                           kv_budget=256, keep_kv_gb=40.0, release_kv_gb=40.0, cpu_smoke=False, set=[], per_step=(2.0, 2.0))

    def config(mode, *extra, recipe="1gpu"):
        args.set = list(extra)
        return load_config(TrainConfig, str(RECIPES[recipe]), overrides(args, mode, "prefix_sliding:1024", Path("/tmp/r")))

    for mode in ("keep", "release"):
        cfg = config(mode)
        assert (cfg.train.mode, cfg.rollout.max_inflight_groups, cfg.engine.max_num_seqs) == ("sync", 4, 32)
    assert config("release").rollout.release_between_steps and not config("keep").rollout.release_between_steps
    cfg = config("async")
    assert (cfg.train.mode, cfg.train.max_staleness, cfg.rollout.max_inflight_groups) == ("async", 2, 8)
    assert (cfg.rollout.queue_size, cfg.engine.max_num_seqs, cfg.engine.kv_cache_gb) == (8, 64, 40.0)
    assert cfg.stale_drop_warning() is None and not cfg.rollout.release_between_steps
    assert config("as-is").train.mode == "async" and config("keep", "train.mode=async").train.mode == "async"
    ngpu = load_config(TrainConfig, str(RECIPES["ngpu"]), [f"model.path={checkpoint}"])
    assert (ngpu.rollout.max_inflight_groups / ngpu.train.groups_per_step, ngpu.rollout.queue_size / ngpu.train.groups_per_step) == args.per_step
    cfg = config("as-is", recipe="ngpu")
    assert (cfg.train.mode, cfg.train.max_staleness, cfg.engine.kv_cache_gb, cfg.weight_sync.backend) == ("async", 2, None, "broadcast")
    assert (cfg.rollout.max_inflight_groups, cfg.rollout.queue_size, cfg.engine.max_num_seqs) == (8, 8, 64)


SMOKE = ["--cpu-smoke", "--groups", "2", "--group-size", "2", "--max-tokens", "16", "--steps", "1", "--warmup", "1",
         "--run-timeout-s", "400"]


@pytest.fixture(scope="module")
def colocated(tmp_path_factory, checkpoint):
    if not MATH500.is_file():
        pytest.skip("needs ../shared/data/math500-dev.jsonl")
    out, work = tmp_path_factory.mktemp("colocate-out"), tmp_path_factory.mktemp("colocate-work")
    subprocess.run([sys.executable, "benchmarks/colocate.py", *SMOKE, "--modes", "keep", "release", "async", "--model",
                    str(checkpoint), "--out", str(out), "--work", str(work)], cwd=ROOT, check=True, timeout=900,
                   capture_output=True, text=True)
    return out, work


@pytest.mark.slow
@pytest.mark.timeout(1000)  # its own subprocess limits are longer than the suite's per-test timeout
def test_colocate_runs_the_recipe_keeping_and_releasing_the_pool(colocated):
    # catches: rollout.release_between_steps not reaching the driver or the workers (no release seconds in the
    # step reports, or a run that hangs or fails when the pool is freed and re-allocated through Ray), a
    # results row that does not match its own metrics, and an output folder with more files than a GPU
    # machine sends back (at most 8); and the recipe's own async mode not running ahead of the learner: the
    # second step trains groups sampled before the first update (staleness 1), where a sync run shows 0 (planted:
    # the async mode's train.mode=sync fails here; its in-flight count is test_colocate_modes_pin_..., above)
    out, work = colocated
    rows = {r["mode"]: r for r in map(json.loads, (out / "results.jsonl").read_text().splitlines())}
    assert [rows[m]["status"] for m in ("keep", "release", "async")] == ["ok", "ok", "ok"]
    assert [s["staleness_mean"] for s in rows["async"]["steps"]][:2] == [0.0, 1.0] and rows["async"]["gen_s"] is None
    assert all(s["staleness_mean"] == 0.0 for s in rows["keep"]["steps"]) and rows["keep"]["gen_s"] is not None
    release, keep = rows["release"], rows["keep"]
    assert all(s["memory_release_seconds"] > 0 for s in release["steps"])
    assert not any("memory_release_seconds" in s for s in keep["steps"])
    last = release["steps"][-1]
    assert release["tokens_per_step"] == last["completion_tokens"] * 2 * 2  # 2 groups x 2 samples
    assert release["step_s"] == pytest.approx(last["elapsed_s"] - release["steps"][-2]["elapsed_s"])
    assert sorted(p.name for p in out.iterdir()) == ["logs.tar.gz", "results.jsonl"]
    with tarfile.open(out / "logs.tar.gz") as tar:
        assert {"run-release-prefix_sliding1024.log", "run-release-prefix_sliding1024/metrics.jsonl"} <= set(tar.getnames())


@pytest.mark.slow
@pytest.mark.timeout(1000)
def test_trl_peer_puts_trls_grpo_beside_sliderls_row(colocated, checkpoint, tmp_path):
    # catches: a TRL run that fails with this model, data and settings (TRL's own API drifts between
    # releases), step records that miss the generation or its tokens, and a sliderl row taken from a run
    # of another shape (the check must refuse it); a length budget of 4 tokens makes rewards vary inside a group,
    # so TRL's step has a gradient: catches a non-finite or zero update (the H200 run of 2026-12-02 logged
    # grad_norm nan); planted by dropping --kv-budget 4 (all rewards 0: grad_norm 0, this fails)
    pytest.importorskip("trl")
    out, _ = colocated
    args = [sys.executable, "benchmarks/trl_peer.py", *SMOKE, "--model", str(checkpoint), "--sliderl",
            str(out / "results.jsonl"), "--work", str(tmp_path / "work"), "--kv-budget", "4"]
    subprocess.run(args + ["--out", str(tmp_path / "out")], cwd=ROOT, check=True, timeout=600, capture_output=True)
    rows = {r["run"].split(":")[0]: r for r in map(json.loads, (tmp_path / "out/results.jsonl").read_text().splitlines())}
    trl, ours = rows["trl"], rows["sliderl"]
    assert trl["status"] == ours["status"] == "ok" and trl["timed_steps"] == 1
    step = trl["steps"][-1]
    assert 0 < step["gen_s"] < step["end"] - step["begin"] and 0 < step["tokens"] <= 2 * 2 * 16
    assert trl["tokens_per_step"] == step["tokens"] and ours["tokens_per_step"] > 0
    norms = [float(n) for n in re.findall(r"'grad_norm': '([^']*)'", (tmp_path / "out/trl.log").read_text())]
    assert len(norms) == 2 and all(math.isfinite(n) and n > 0 for n in norms), norms
    wrong = subprocess.run(args[:3] + ["--groups", "3"] + args[5:] + ["--out", str(tmp_path / "o2")], cwd=ROOT,
                           capture_output=True, text=True, timeout=600)
    assert wrong.returncode != 0 and "differs from this one" in wrong.stderr
