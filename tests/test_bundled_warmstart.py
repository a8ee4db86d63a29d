"""The warm start bundled with sliderl (``sliderl/assets/warmstart``, made by ``sliderl.cluster.run.bundle``): the
default job's key names it, it is the warm-started model its marker says, a cache miss copies it without
training, and the key stays put when a setting is added at its default or transformers writes another version."""

import dataclasses
import json
import shutil

import pytest

from sliderl.trainer.algorithms import SFTOptions
from sliderl.trainer.learner_args import LearnerArgs
from sliderl.trainer.manifest import Manifest
from sliderl.trainer.sft import MARKER, SFTArgs, SFTExample, bundled, cached_sft, changed_settings, fingerprint


@pytest.fixture(scope="module")
def default_job(tmp_path_factory):
    from sliderl.cluster.run.bundle import default_key

    key, (cfg, plan) = default_key(run_dir=str(tmp_path_factory.mktemp("default-job") / "run"))
    plan.finish()
    return key, cfg, plan


def test_the_default_job_finds_its_bundled_warm_start(default_job):
    # catches: a change to the default recipe, its task, model or warm-start settings (or to the fingerprint) that
    # leaves the bundle unused, so `sliderl train` silently trains a minute of SFT again before its first RL step
    # (planted: learner.lr 0.01 -> 0.011 under warmstart in configs/tiny-arith.yaml: no bundle has that key).
    # The fix is `python -m sliderl.cluster.run.bundle` in the same change. (The key hashes the initial weights:
    # the same bytes under ATen's AVX2 and AVX512 kernels, ATEN_CPU_CAPABILITY=avx2/avx512, checked 2026-12-05;
    # only its scalar fallback, a CPU without AVX2, draws others, and would train the warm start there.)
    key, _, _ = default_job
    bundle = bundled(key)
    assert bundle is not None, f"no sliderl/assets/warmstart/sft-{key}: python -m sliderl.cluster.run.bundle"
    # every file the manifest lists is there with its size and sha256, and nothing else but the manifest
    # (catches: weights or marker replaced by hand, an optimizer state shipped that RL never reads)
    manifest = Manifest.read(bundle)
    assert manifest is not None and manifest.damage(bundle) is None
    assert {p.name for p in bundle.iterdir()} == set(manifest.files) | {"manifest.json"}
    assert "trainer_state.pt" not in manifest.files


def test_the_bundled_model_decodes_the_held_out_problems_as_its_marker_says(default_job):
    # catches: a bundle whose weights are not the stage's result (the initial model's, another recipe's, an earlier
    # run's): the engine's greedy decoding under the run's own KV policy on the stage's 64 held-out problems,
    # scored as exact match against the task's reference solutions, is the marker's held-out accuracy (the
    # learner's evaluate computed it by another path: one teacher-forced forward); a random model scores 0. (27 of
    # 64 here, and still 27 with every weight moved by 1e-4 of its tensor's mean magnitude, two draws: far more than
    # another CPU's rounding, so the 1/64 allowance is not spent by the machine.)
    from sliderl.rollout import LLM, SamplingParams

    key, cfg, plan = default_job
    bundle = bundled(key)
    marker = json.loads((bundle / MARKER).read_text())["result"]
    held_out = plan.warm_start[1]
    assert len(held_out) == 64
    llm = LLM(str(bundle), kv=cfg.engine.kv)
    prompts = [list(e.prompt_token_ids) if e.prompt_token_ids else llm.tokenizer(e.prompt).input_ids for e in held_out]
    outs = llm.generate(prompts, SamplingParams(max_tokens=cfg.sampling.max_tokens, temperature=0))
    exact = sum(llm.tokenizer.decode(o.token_ids, skip_special_tokens=True) == e.completion
                for o, e in zip(outs, held_out, strict=True))
    assert marker["held_out_accuracy"] >= cfg.warmstart.sft.target_accuracy
    assert abs(exact / 64 - marker["held_out_accuracy"]) <= 1 / 64, (exact, marker["held_out_accuracy"])


def test_a_cache_miss_copies_the_bundle_without_training(tmp_path, monkeypatch):
    # catches: the bundle ignored (the stage trains), trained over, or used in place of the cache (a run's later
    # writes would land in the installed package)
    import sliderl.trainer.sft as sft
    from sliderl.core.tiny import make_tiny_model

    model = make_tiny_model(tmp_path / "init", hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1,
                            intermediate_size=32)
    train, held_out = [SFTExample("1+1=", "2")], []
    args, stage = LearnerArgs(algo=SFTOptions(), lr=1e-3), SFTArgs(steps=2, batch_size=1)
    key = fingerprint(model, train, held_out, "full", args, stage)
    trained = cached_sft(tmp_path / "first", model, train, held_out, "full", args, stage)
    monkeypatch.setattr(sft, "BUNDLED", tmp_path / "bundles")
    shutil.copytree(trained.path, tmp_path / "bundles" / f"sft-{key}")

    def no_training(*a, **k):
        raise AssertionError("the stage trained although its checkpoint is bundled")

    monkeypatch.setattr(sft, "run_sft", no_training)
    found = cached_sft(tmp_path / "cache", model, train, held_out, "full", args, stage)
    assert found.path == str(tmp_path / "cache" / f"sft-{key}")
    assert (tmp_path / "cache" / f"sft-{key}" / "model.safetensors").read_bytes() == \
        (tmp_path / "bundles" / f"sft-{key}" / "model.safetensors").read_bytes()
    assert dataclasses.replace(found, path=trained.path) == trained
    with pytest.raises(AssertionError, match="bundled"):  # another key: no bundle, so it would train
        cached_sft(tmp_path / "cache", model, train, held_out, "full", dataclasses.replace(args, lr=2e-3), stage)


def test_the_key_ignores_settings_at_their_defaults_and_the_transformers_version(tmp_path):
    # catches: a key over every field (each new LearnerArgs setting would orphan every cache and the bundle), or
    # one that misses a changed setting or a changed model config value
    from sliderl.core.tiny import make_tiny_model

    assert changed_settings(LearnerArgs()) == {}
    assert changed_settings(LearnerArgs(lr=0.5)) == {"lr": 0.5}
    assert changed_settings(SFTArgs(batch_size=3)) == {"batch_size": 3}
    model = make_tiny_model(tmp_path / "init", hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1,
                            intermediate_size=32)
    train = [SFTExample("1+1=", "2")]
    key = fingerprint(model, train, [], "full", LearnerArgs(), SFTArgs())
    config = model / "config.json"
    record = json.loads(config.read_text())
    config.write_text(json.dumps({**record, "transformers_version": "0.0.1"}, indent=7))
    assert fingerprint(model, train, [], "full", LearnerArgs(), SFTArgs()) == key
    config.write_text(json.dumps({**record, "rms_norm_eps": 1e-5}))
    assert fingerprint(model, train, [], "full", LearnerArgs(), SFTArgs()) != key
    config.write_text(json.dumps(record))
    assert fingerprint(model, train, [], "full", LearnerArgs(lr=0.5), SFTArgs()) != key
