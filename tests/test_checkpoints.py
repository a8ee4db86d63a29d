"""Checkpoint manifests (issue 11, bug 5): each file's size and sha256, written while saving, checked
against an independent read; a damaged newest checkpoint is skipped for the intact one before it; the
weights file is what safetensors itself writes; a driver state that does not read names its file.
"""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest
import torch
from cluster_jobs import model_dir, tiny_overrides  # noqa: F401 (fixture)
from safetensors.torch import load_file, save, save_file
from transformers import AutoModelForCausalLM

from sliderl.cluster.cli import main
from sliderl.cluster.run.checkpoints import Checkpoints, DamagedCheckpoint, DriverState
from sliderl.core.trace import Trace
from sliderl.trainer.algorithms import SFTOptions
from sliderl.trainer.checkpoint import write_safetensors
from sliderl.trainer.learner import Learner
from sliderl.trainer.manifest import MANIFEST, Manifest


def sft_batch(seed: int) -> list[list[Trace]]:
    """Two random 6-token prompts with 8-token completions, trained as SFT data."""
    gen = torch.Generator().manual_seed(seed)
    return [[Trace(f"t{seed}.{i}", "g", "p", 0, 0, "full", torch.randint(0, 256, (6,), generator=gen).tolist(),
                   torch.randint(0, 256, (8,), generator=gen).tolist(), [], "length") for i in range(2)]]


def state_at(step: int) -> DriverState:
    return DriverState(step=step, version=step, published_version=step, cursor=2 * step)


@pytest.fixture(scope="module")
def saved_run(tiny_model_factory, tmp_path_factory):
    """A run directory with checkpoints step_000001 and step_000002 written by ``Checkpoints.save`` from a
    real learner (one SFT step between them); the learner's weights at each step."""
    run = tmp_path_factory.mktemp("ckpts") / "run"
    learner = Learner(str(tiny_model_factory("qwen3")), algo=SFTOptions(), lr=1e-2)
    checkpoints, weights = Checkpoints(run, keep=2), {}
    for step in (1, 2):
        learner.step(sft_batch(step))
        checkpoints.save(step, state_at(step), learner.save_checkpoint)
        weights[step] = learner.state_dict()
    return run, weights


@pytest.fixture
def run_copy(saved_run, tmp_path):
    """A private copy of ``saved_run``'s directory, to damage."""
    run, weights = saved_run
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    return copy, weights


def truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def flip_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


DAMAGE = {  # what is done to the newest checkpoint -> the file the warning must name
    "truncated model": (lambda ckpt: truncate(ckpt / "model.safetensors"), "model.safetensors"),
    "truncated trainer state": (lambda ckpt: truncate(ckpt / "trainer_state.pt"), "trainer_state.pt"),
    "one byte flipped (same size)": (lambda ckpt: flip_byte(ckpt / "trainer_state.pt"), "trainer_state.pt"),
    "corrupt driver state": (lambda ckpt: (ckpt / "driver_state.json").write_text('{"step": 2,\n'),
                             "driver_state.json"),
    "tokenizer file deleted": (lambda ckpt: (ckpt / "tokenizer.json").unlink(), "tokenizer.json"),
    "corrupt manifest": (lambda ckpt: (ckpt / MANIFEST).write_text("{"), MANIFEST),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_newest_checkpoint_is_skipped_for_the_intact_one_before_it(run_copy, damage, capsys):
    # Catches (issue 11, bug 5): latest() returned the newest complete folder whatever its files held,
    # so a truncated model.safetensors or trainer_state.pt made the learner fail on it at every restart
    # and the intact older checkpoint was never tried. Planted: load() without the manifest's damage
    # check returns step_000002 for the four file damages; damage() comparing sizes only misses the
    # flipped byte; latest() walking oldest first never looks at step_000002.
    run, weights = run_copy
    spoil, file = DAMAGE[damage]
    spoil(run / "checkpoints" / "step_000002")
    path, state = Checkpoints(run).latest()
    assert path.name == "step_000001" and state == state_at(1)
    warning = capsys.readouterr().err
    assert "step_000002" in warning and file in warning, warning
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000001", "step_000002.damaged"]
    resumed = Learner.from_checkpoint(path)  # the fallback really is the step-1 learner
    assert resumed.version == 1 and all(torch.equal(resumed.state_dict()[n], w) for n, w in weights[1].items())


def test_intact_checkpoints_resume_from_the_newest_without_a_warning(run_copy, capsys):
    # Catches: latest() settling for an older checkpoint than the newest intact one, and a check that
    # rejects what the saver wrote. Planted by walking the checkpoints oldest first, latest() returns
    # step_000001; by listing manifest.json in itself (it changes when written), both are skipped.
    run, _ = run_copy
    path, state = Checkpoints(run).latest()
    assert path.name == "step_000002" and state == state_at(2) and capsys.readouterr().err == ""


def test_manifest_sizes_and_checksums_match_an_independent_read(saved_run):
    # Catches: a checksum or size taken of the wrong bytes (a hashing writer that drops or repeats a
    # chunk, an entry filed under another file's name) and a file left out of the manifest. Planted
    # by hashing all but the last byte of each write, every big file's sha256 differs.
    run, _ = saved_run
    ckpt = run / "checkpoints" / "step_000002"
    manifest = json.loads((ckpt / MANIFEST).read_text())
    on_disk = {p.name for p in ckpt.iterdir()} - {MANIFEST, "COMPLETE"}
    assert set(manifest["files"]) == on_disk
    assert {"model.safetensors", "trainer_state.pt", "config.json", "driver_state.json", "tokenizer.json"} <= on_disk
    for name, entry in manifest["files"].items():
        data = (ckpt / name).read_bytes()
        assert entry == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}, name


def test_a_learner_checkpoint_alone_carries_a_manifest_that_verifies(tiny_model_factory, tmp_path):
    # Catches: a manifest only a run's Checkpoints.save writes, so a checkpoint saved by
    # Learner.save_checkpoint alone (SFT output, tests) cannot be checked. Planted by writing the
    # manifest in Checkpoints.save only, there is no manifest.json.
    learner = Learner(str(tiny_model_factory("qwen3")), algo=SFTOptions(), lr=1e-2)
    returned = learner.save_checkpoint(tmp_path / "ckpt")
    on_disk = Manifest.read(tmp_path / "ckpt")
    assert on_disk == returned and on_disk.damage(tmp_path / "ckpt") is None
    assert set(on_disk.files) == {p.name for p in (tmp_path / "ckpt").iterdir()} - {MANIFEST}
    flip_byte(tmp_path / "ckpt" / "model.safetensors")
    assert "model.safetensors" in on_disk.damage(tmp_path / "ckpt")



def test_loading_a_damaged_checkpoint_outside_a_run_names_the_file(tiny_model_factory, tmp_path, capsys):
    # Catches: Learner.from_checkpoint and `sliderl eval` loading a damaged checkpoint (a flipped byte:
    # same size, so only the checksum sees it) without a word, training on or scoring corrupted
    # weights. Both check the manifest first: the learner raises naming the file, eval exits 2
    # naming it. Planted by dropping check_intact from from_checkpoint (it loads) or from run_eval
    # (it scores), this fails.
    from sliderl.cluster.cli import main

    learner = Learner(str(tiny_model_factory("qwen3")), algo=SFTOptions(), lr=1e-2)
    learner.save_checkpoint(tmp_path / "ckpt")
    assert Learner.from_checkpoint(tmp_path / "ckpt").version == 0  # intact: loads
    flip_byte(tmp_path / "ckpt" / "model.safetensors")
    with pytest.raises(ValueError, match=r"is damaged: .*model.safetensors does not match its sha256"):
        Learner.from_checkpoint(tmp_path / "ckpt")
    code = main(["eval", str(tmp_path / "ckpt"), "eval.num_problems=2"])
    err = capsys.readouterr().err
    assert code == 2 and "model.safetensors does not match its sha256" in err, err

@pytest.mark.parametrize("tied", [True, False])
def test_streamed_weights_are_what_safetensors_writes_and_transformers_reads(tiny_model_factory, tmp_path, tied):
    # Catches: a hand-written safetensors writer that differs from the library's (header layout,
    # tensor order, offsets, padding, a tied head stored twice): the bytes are compared with
    # safetensors' own serializer, the tensors with load_file, and transformers' logits with those of
    # the same weights written by save_file. Planted: a tied head stored twice fails the keys (tied
    # case); shapes written reversed fail load_file's tensors even without the byte comparison; no
    # header padding is seen by the byte comparison only (safetensors reads such files).
    learner = Learner(str(tiny_model_factory("qwen3", tie_word_embeddings=tied)), algo=SFTOptions(), lr=1e-2)
    learner.step(sft_batch(0))
    ckpt, reference = tmp_path / "ckpt", tmp_path / "reference"
    learner.save_checkpoint(ckpt)
    weights = learner.state_dict()
    assert ("lm_head.weight" in weights) is not tied
    assert (ckpt / "model.safetensors").read_bytes() == save(weights, metadata={"format": "pt"})
    loaded = load_file(ckpt / "model.safetensors")
    assert loaded.keys() == weights.keys() and all(torch.equal(loaded[n], weights[n]) for n in weights)
    shutil.copytree(ckpt, reference, ignore=shutil.ignore_patterns("model.safetensors"))
    save_file(weights, reference / "model.safetensors", metadata={"format": "pt"})
    ids = torch.tensor([[5, 17, 200, 3, 99, 42]])
    with torch.no_grad():
        ours = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)(ids).logits
        theirs = AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32)(ids).logits
    assert torch.equal(ours, theirs)


def test_write_safetensors_matches_the_library_for_every_dtype_and_shape(tmp_path):
    # Catches: dtype names, sort order across dtypes of one item size, 0-d / empty / non-contiguous
    # tensors written unlike safetensors. Planted by sorting by item size then name instead of the
    # library's dtype order, F16/BF16, I32/F32 and F64/I64 come out in name order and the bytes differ.
    gen = torch.Generator().manual_seed(0)
    tensors = {"w": torch.randn(3, 5, generator=gen), "bf": torch.randn(4, generator=gen).bfloat16(),
               "a_half": torch.randn(3, generator=gen).half(), "ids": torch.arange(4), "i32": torch.arange(3).int(),
               "scalar": torch.tensor(2.5), "empty": torch.zeros(0), "mask": torch.tensor([True, False, True]),
               "t": torch.randn(4, 6, generator=gen).t(), "i8": torch.arange(-3, 4, dtype=torch.int8),
               "u8": torch.arange(5, dtype=torch.uint8), "i16": torch.arange(3, dtype=torch.int16),
               "f64": torch.randn(2, generator=gen).double()}
    entry = write_safetensors(tmp_path / "x.safetensors", tensors, {"format": "pt"})
    data = (tmp_path / "x.safetensors").read_bytes()
    assert data == save({k: v.contiguous() for k, v in tensors.items()}, metadata={"format": "pt"})
    assert (entry.size, entry.sha256) == (len(data), hashlib.sha256(data).hexdigest())


def test_a_set_aside_checkpoint_does_not_count_toward_keep(run_copy):
    # Catches: prune counting a damaged checkpoint among the newest `keep`: after falling back to
    # step 1 past a damaged step 2, a save at step 3 (checkpoint.every changed) would delete step 1
    # and keep the damaged step 2 -- the checkpoint the next fallback needs would be gone. Planted by
    # only warning (not setting the damaged folder aside), step_000001 is deleted.
    run, _ = run_copy
    truncate(run / "checkpoints" / "step_000002" / "model.safetensors")
    checkpoints = Checkpoints(run, keep=2)
    path, _ = checkpoints.latest()
    checkpoints.save(3, state_at(3), Learner.from_checkpoint(path).save_checkpoint)
    assert [p.name for p in checkpoints.complete()] == ["step_000001", "step_000003"]
    assert checkpoints.latest()[0].name == "step_000003"


def test_a_checkpoint_without_a_manifest_is_accepted_and_a_bad_state_names_its_file(run_copy, capsys):
    # Catches: runs checkpointed before manifests no longer resuming, and (issue 11, bug 5) a corrupt
    # driver_state.json failing with json's bare "Expecting value: line 2 column 1" that names no
    # file. Planted by reading the state without DriverState.read's wrapper, the message has no path.
    run, _ = run_copy
    for ckpt in (run / "checkpoints").iterdir():
        (ckpt / MANIFEST).unlink()
    assert Checkpoints(run).latest()[0].name == "step_000002" and capsys.readouterr().err == ""
    state_file = run / "checkpoints" / "step_000002" / "driver_state.json"
    state_file.write_text('{"step": 2,\n')
    with pytest.raises(DamagedCheckpoint) as err:
        Checkpoints(run).latest()
    assert str(state_file) in str(err.value) and "Expecting" in str(err.value)
    assert (run / "checkpoints" / "step_000002").is_dir()  # not set aside: the user decides
    shutil.rmtree(run / "checkpoints" / "step_000002")  # what the message asks for
    (run / "checkpoints" / "step_000001" / "trainer_state.pt").unlink()
    with pytest.raises(DamagedCheckpoint, match="step_000001 lacks trainer_state.pt"):
        Checkpoints(run).latest()


@pytest.mark.parametrize("text, problem", [
    ("[1, 2]", "expected a JSON object, got list"),
    ('{"stepz": 1}', "unknown keys ['stepz']"),
    (json.dumps({**json.loads(state_at(1).to_json()), "cursor": "3"}), "cursor must be an integer"),
    (json.dumps({**json.loads(state_at(1).to_json()), "ledger": {"trained": [], "lost": []}}), "ledger must be"),
])
def test_a_driver_state_with_wrong_keys_names_the_file_and_the_key(tmp_path, text, problem):
    # Catches: a driver state with wrong keys or types loading as a silent default (a missing step
    # read as 0) or failing in the dataclass with a TypeError that names no file. Planted by the old
    # from_json (unknown keys dropped, no checks), "stepz" loads as DriverState(step=0) and cursor "3"
    # loads as a string.
    path = tmp_path / "driver_state.json"
    path.write_text(text)
    with pytest.raises(DamagedCheckpoint) as err:
        DriverState.read(path)
    assert str(path) in str(err.value) and problem in str(err.value)


def test_resume_from_a_bad_legacy_state_is_exit_2_naming_the_file(run_copy, model_dir, capsys):
    # Catches: the CLI's resume=true surfacing a corrupt driver_state.json as a traceback (or exit 1
    # after Ray started) instead of exit 2 with the file named, before Ray starts. Planted by letting
    # DamagedCheckpoint escape prepare() unwrapped as a RuntimeError, main() raises it.
    run, _ = run_copy
    for ckpt in (run / "checkpoints").iterdir():
        (ckpt / MANIFEST).unlink()
    state_file = run / "checkpoints" / "step_000002" / "driver_state.json"
    state_file.write_text("")
    assert main(["train", *tiny_overrides(model_dir, run), "resume=true"]) == 2
    err = capsys.readouterr().err
    assert "resume=true" in err and str(state_file) in err and "Expecting value" in err
