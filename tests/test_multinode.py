"""Nothing assumes one node (issue 15, scope 4): a run's storage root in an S3 bucket (moto's server
on 127.0.0.1, the real pyarrow S3 client; every check reads the bucket with boto3 and pyarrow, not
through sliderl), and a run on a real two-node Ray cluster that writes its checkpoints, traces and
driver state there, loses every local folder, and is resumed by a fresh driver from the bucket alone.
Its learner has two ranks, one on each node (issue 36): gradients, checkpoint shards and the weight
sync cross the node boundary.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from cluster_jobs import ray_session, tiny_overrides  # noqa: F401 (fixture)
from test_trace_log import make_trace

from sliderl.cluster.actors.learner import LearnerActor
from sliderl.cluster.actors.placement import ResourceError, bundles, check_resources
from sliderl.cluster.cli import main
from sliderl.cluster.config.base import load_config
from sliderl.cluster.config.train import TrainConfig
from sliderl.cluster.run.checkpoints import Checkpoints, DriverState
from sliderl.cluster.storage.trace_log import TraceLog
from sliderl.core.trace import Trace
from sliderl.trainer.algorithms import SFTOptions
from sliderl.trainer.learner_args import LearnerArgs
from sliderl.trainer.sft import SFTArgs, SFTExample

ROOT = Path(__file__).resolve().parents[1]
BUCKET = "sliderl"
CKPT_FILES = {"config.json", "model.safetensors", "trainer_state.pt", "tokenizer.json", "driver_state.json",
              "manifest.json", "COMPLETE"}
SHARD_FILES = {".metadata", "__0_0.distcp", "__1_0.distcp"}  # a learner of two ranks: its optimizer's shard set


# ------------------------------------------------------------------------------ the S3 server


@pytest.fixture(scope="module")
def s3():
    """moto's S3 server on a free port of 127.0.0.1 (its own process, stopped by pid), the AWS variables
    pyarrow's S3 client reads, and a boto3 client on it with the bucket ``sliderl``."""
    import boto3

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "sliderl",
           "AWS_SECRET_ACCESS_KEY": "sliderl", "AWS_DEFAULT_REGION": "us-east-1"}
    with pytest.MonkeyPatch.context() as patch:
        for key, value in env.items():
            patch.setenv(key, value)
        try:
            deadline = time.monotonic() + 60
            while True:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                    break
                except OSError:
                    assert time.monotonic() < deadline and server.poll() is None, "moto did not start"
                    time.sleep(0.1)
            client = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"])
            client.create_bucket(Bucket=BUCKET)
            yield client
        finally:
            server.terminate()
            server.wait(timeout=30)


def objects(s3, prefix: str) -> dict[str, bytes]:
    """Every object under ``prefix``, by key relative to it (pyarrow's empty folder markers left out)."""
    found = {}
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix + "/"):
        for item in page.get("Contents", []):
            if item["Key"].endswith("/"):
                continue
            found[item["Key"][len(prefix) + 1:]] = s3.get_object(Bucket=BUCKET, Key=item["Key"])["Body"].read()
    return found


def sft_step(learner, seed: int) -> None:
    """One SFT step on two random 6-token prompts with 8-token completions."""
    gen = torch.Generator().manual_seed(seed)
    learner.step([[Trace(f"t{seed}.{i}", "g", "p", 0, 0, "full", torch.randint(0, 256, (6,), generator=gen).tolist(),
                         torch.randint(0, 256, (8,), generator=gen).tolist(), [], "length") for i in range(2)]])


# ----------------------------------------------------------------------------- checkpoints in S3


def test_checkpoints_in_a_bucket_are_written_marker_last_checked_and_resumed(s3, tiny_model_factory, capsys):
    # Catches: a checkpoint in object storage that a crash can leave looking complete (the marker
    # written before the learner's files, or before the state and manifest), one whose objects differ
    # from its manifest, a damaged newest one trusted on resume, and a learner that cannot resume from
    # a URI. Planted: the marker written first in Checkpoints.save, the crashed step_000003 holds a
    # COMPLETE; _remote_damage without its sha256 pass, latest() returns the flipped step_000002;
    # LearnerActor.save_checkpoint without its upload, the bucket lacks model.safetensors and
    # trainer_state.pt.
    root = f"s3://{BUCKET}/ckpt"
    actor = LearnerActor(str(tiny_model_factory("qwen3")), LearnerArgs(algo=SFTOptions(), lr=1e-2), "object_store")
    checkpoints, weights = Checkpoints(root, keep=2), {}
    for step in (1, 2):
        sft_step(actor.learner, step)
        checkpoints.save(step, DriverState(step=step, version=step, cursor=2 * step), actor.save_checkpoint)
        weights[step] = actor.learner.state_dict()
    stored = objects(s3, "ckpt/checkpoints/step_000002")
    assert CKPT_FILES <= set(stored)
    manifest = json.loads(stored["manifest.json"])["files"]
    assert set(manifest) == set(stored) - {"manifest.json", "COMPLETE"}
    for name, entry in manifest.items():  # checked against boto3's bytes, not sliderl's reader
        assert entry == {"size": len(stored[name]), "sha256": hashlib.sha256(stored[name]).hexdigest()}, name
    assert json.loads(stored["driver_state.json"])["step"] == 2

    def crash_midway(location: str):
        s3.put_object(Bucket=BUCKET, Key="ckpt/checkpoints/step_000003/config.json", Body=b"{}")
        raise ConnectionError("the learner's node went away")

    with pytest.raises(ConnectionError):
        checkpoints.save(3, DriverState(step=3), crash_midway)
    assert "COMPLETE" not in objects(s3, "ckpt/checkpoints/step_000003")
    path, state = checkpoints.latest()
    assert path.name == "step_000002" and state.step == 2 and state.cursor == 4

    model_key = "ckpt/checkpoints/step_000002/model.safetensors"
    damaged = bytearray(stored["model.safetensors"])
    damaged[len(damaged) // 2] ^= 1  # same size: only the checksum sees it
    s3.put_object(Bucket=BUCKET, Key=model_key, Body=bytes(damaged))
    capsys.readouterr()
    path, state = Checkpoints(root, keep=2).latest()
    assert path.name == "step_000001" and state.step == 1
    warning = capsys.readouterr().err
    assert f"s3://{BUCKET}/{model_key} does not match its sha256" in warning, warning
    assert set(objects(s3, "ckpt/checkpoints/step_000002.damaged")) == set(stored)  # set aside, marker included
    assert not objects(s3, "ckpt/checkpoints/step_000002")

    resumed = LearnerActor("unused", LearnerArgs(algo=SFTOptions(), lr=1e-2), "object_store",
                           checkpoint=f"{root}/checkpoints/step_000001")
    assert resumed.version() == 1
    assert all(torch.equal(resumed.learner.state_dict()[n], w) for n, w in weights[1].items())


# ------------------------------------------------------------------------------ traces in S3


def test_a_trace_log_in_a_bucket_appends_whole_parts_and_rolls_back(s3):
    # Catches: parts in object storage that a second driver overwrites (numbering restarted at 0 after
    # a resume), a failed append that leaves a partial object, and a rollback that loses rows of
    # the groups it keeps. Planted: TraceLog numbering from 0 on a URI root, the second driver's
    # part replaces part-000000 (two parts where three were appended).
    root = f"s3://{BUCKET}/traces-run"
    first = TraceLog(root)
    first.append([make_trace(0), make_trace(1)])
    first.append([make_trace(2), make_trace(3)])
    with pytest.raises(Exception):  # noqa: B017 (pyarrow's conversion error): a bad row adds no object
        first.append([make_trace(4, completion_token_ids="not a list")])
    second = TraceLog(root)  # a fresh driver, as after a resume
    second.append([make_trace(4), make_trace(5)])
    parts = objects(s3, "traces-run/traces")
    assert sorted(parts) == ["part-000000.parquet", "part-000001.parquet", "part-000002.parquet"]
    read = {name: pq.read_table(io.BytesIO(data)).column("trace_id").to_pylist() for name, data in parts.items()}
    assert read == {"part-000000.parquet": ["t0", "t1"], "part-000001.parquet": ["t2", "t3"],
                    "part-000002.parquet": ["t4", "t5"]}
    assert second.count() == 6
    assert second.keep_groups({"g0", "g2"}) == 2  # g1 = traces t2, t3: part-000001 goes
    parts = objects(s3, "traces-run/traces")
    assert sorted(parts) == ["part-000000.parquet", "part-000002.parquet"]
    assert TraceLog(root).read(["trace_id"]).column("trace_id").to_pylist() == ["t0", "t1", "t4", "t5"]


# ------------------------------------------------------------------- the warm start's cache in S3


def test_the_warm_start_cache_in_a_bucket_is_whole_or_absent_and_reused(s3, tiny_model_factory, tmp_path,
                                                                        monkeypatch, capsys):
    # Catches: a warm start cached in object storage whose marker (sft.json) is uploaded before the
    # weights, so an upload cut short is later taken for a finished checkpoint; and a node without
    # its local copy training the stage again instead of downloading it. Planted: Storage.upload
    # sending ``last`` first, sft.json is in the bucket after the cut; cached_warm_start not looking
    # in the bucket, the third call trains ("sft step" printed).
    from pyarrow import fs

    from sliderl.cluster.actors.warm_start import cached_warm_start

    node = tmp_path / "node"  # this "node"'s TMPDIR, where its copy of the checkpoint goes
    node.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(node))
    examples = [SFTExample(f"{i} + 1 =", str(i + 1)) for i in range(6)]
    args = (f"s3://{BUCKET}/cache", str(tiny_model_factory("qwen3")), examples[:4], examples[4:], "full",
            LearnerArgs(algo=SFTOptions(), lr=1e-2), SFTArgs(steps=2, batch_size=2, log_every=1))
    copy_files, calls = fs.copy_files, []

    def cut_short(source, dest, **kw):
        calls.append(dest)
        if len(calls) == 3:
            raise OSError("connection reset by peer")
        return copy_files(source, dest, **kw)

    monkeypatch.setattr(fs, "copy_files", cut_short)
    with pytest.raises(OSError, match="connection reset"):
        cached_warm_start(*args)
    assert objects(s3, "cache") and not any(key.endswith("sft.json") for key in objects(s3, "cache"))
    monkeypatch.setattr(fs, "copy_files", copy_files)
    capsys.readouterr()
    result, stored = cached_warm_start(*args)
    assert "sft step 2/2" in capsys.readouterr().out  # the cut upload was not taken for a checkpoint
    kept = objects(s3, f"cache/{stored.rsplit('/', 1)[1]}")
    assert {"sft.json", "model.safetensors", "trainer_state.pt", "config.json"} <= set(kept)
    shutil.rmtree(node)
    node.mkdir()  # a node that never saw the stage
    again, stored_again = cached_warm_start(*args)
    assert "sft step" not in capsys.readouterr().out and stored_again == stored
    assert (Path(again.path) / "model.safetensors").read_bytes() == kept["model.safetensors"]
    assert Path(again.path).parent == node / "sliderl-warmstart" and again.losses == result.losses


# ----------------------------------------------------------------------------- bad roots


@pytest.mark.parametrize("run_dir, message", [
    ("foo://bucket/run", "run_dir: 'foo://bucket/run': unknown storage scheme 'foo'; use a local path or a URI of s3://"),
    ("s3:///run", "run_dir: 's3:///run' names no bucket or host; write s3://BUCKET/prefix"),
    ("s3://no-such-bucket/run", "run_dir 's3://no-such-bucket/run' cannot be written ("),
])
def test_a_bad_storage_root_is_exit_2_before_ray(s3, tiny_model_factory, tmp_path, run_dir, message, capsys):
    # Catches: a run_dir URI that is malformed, of a scheme pyarrow does not open, or whose bucket does
    # not exist, surfacing as a traceback after Ray started, or found only when the run first opens
    # it. Planted: without the run_dir validator the malformed ones fail later, in Storage, without
    # naming run_dir; without the OSError wrapper in _open_run the missing bucket's OSError escapes
    # main() as a traceback.
    import ray

    args = tiny_overrides(tiny_model_factory("qwen3"), tmp_path / "unused")
    capsys.readouterr()
    was_running = ray.is_initialized()
    assert main(["train", *args, f"run_dir={run_dir}"]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
    assert ray.is_initialized() == was_running


def test_custom_resources_reach_the_bundles_and_an_unknown_one_is_refused():
    # Catches: learner.resources / rollout.resources / warmstart.resources accepted by the config but
    # not asked of Ray (actors land anywhere), and a resource no node has failing after the placement
    # group times out instead of before any actor. Planted by _bundle ignoring ``custom``, the
    # bundles lack node_b and no error is raised for node_c.
    cfg = load_config(TrainConfig, None, ["learner.resources={node_b: 1}", "rollout.resources={node_b: 0.5}",
                                          "rollout.num_workers=2", "warmstart.num_cpus=1",
                                          "warmstart.resources={node_c: 1}"])
    assert bundles(cfg) == [{"CPU": 1.0, "node_b": 1.0}, {"CPU": 0.5, "node_b": 0.5}, {"CPU": 0.5, "node_b": 0.5}]
    head, node_b = {"CPU": 2.0}, {"CPU": 2.0, "node_b": 4.0}
    with pytest.raises(ResourceError, match=r"no node of the Ray cluster can hold one actor's bundle \{'CPU': 1.0, "
                                            r"'node_c': 1.0\}"):
        check_resources(cfg, {"CPU": 4.0, "node_b": 4.0}, [head, node_b])


# ------------------------------------------------------------------------- the model on other nodes


def test_model_files_reach_another_node_as_a_copy_of_the_folder(ray_session, tiny_model_factory, tmp_path,
                                                                 monkeypatch):
    # Catches: an actor on another node opening the driver's path (not there), a copy that differs
    # from the folder (a file left out, bytes changed), a copy rewritten by every actor of the node,
    # and a folder that was never shipped being opened elsewhere without a word. Planted: local_path
    # returning ``path`` whatever the node, the copy is not under this node's TMPDIR.
    from sliderl.cluster.storage.model_files import ModelFiles

    model = tiny_model_factory("qwen3")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    here = ModelFiles.ship(str(model), multi_node=True)
    assert here.local_path() == str(model)  # the node that holds the folder opens it in place
    elsewhere = dataclasses.replace(here, node_id="0" * 56)  # as an actor on another node sees it
    copy = Path(elsewhere.local_path())
    assert copy.parent == tmp_path / "sliderl-models"
    folder = {p.relative_to(model): p.read_bytes() for p in model.rglob("*") if p.is_file()}
    assert {p.relative_to(copy): p.read_bytes() for p in copy.rglob("*") if p.is_file()} == folder
    written = (copy / "model.safetensors").stat().st_mtime_ns
    assert elsewhere.local_path() == str(copy) and (copy / "model.safetensors").stat().st_mtime_ns == written
    with pytest.raises(RuntimeError, match="its files were not shipped"):
        dataclasses.replace(ModelFiles.ship(str(model), multi_node=False), node_id="0" * 56).local_path()


# ------------------------------------------------------------------------ two nodes, one bucket

ISOLATE = ["unshare", "--user", "--map-root-user", "--net", "--pid", "--fork", "--mount-proc"]
LOOPBACK_UP = ("import fcntl, socket, struct; fcntl.ioctl(socket.socket(socket.AF_INET, socket.SOCK_DGRAM), 0x8914, "
               "struct.pack('16sH22x', b'lo', 0x1 | 0x8 | 0x40))")
RUN = f"s3://{BUCKET}/run"
GROUPS, SAMPLES = 2, 4  # per step (cluster_jobs.tiny_overrides)


def namespaces_work() -> bool:
    try:
        return subprocess.run([*ISOLATE, sys.executable, "-c", LOOPBACK_UP], capture_output=True,
                              timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def job(model: Path, steps: int, *extra: str) -> list[str]:
    """The tiny job on the cluster: sync GRPO with a learner of two ranks, rank 0 pinned to node a and rank 1 to
    node b (so its gradients, its checkpoint shards and the weight sync cross the node boundary), the worker
    pinned to node b, a 3-step warm start pinned to the head (node a), run_dir and the warm start's cache in
    the bucket."""
    return [*tiny_overrides(model, RUN), "train.mode=sync", f"train.steps={steps}", "checkpoint.every=1",
            "warmstart.enabled=true", f"warmstart.cache_dir=s3://{BUCKET}/warmstart", "warmstart.sft.steps=3",
            "warmstart.sft.batch_size=4", "warmstart.sft.log_every=1", "warmstart.data.held_out=2",
            "warmstart.num_cpus=1", "warmstart.resources={node_a: 1}", "learner.num_ranks=2",
            "learner.num_cpus=0.5", "learner.rank_resources=[{node_a: 1}, {node_b: 1}]",
            "rollout.resources={node_b: 1}",
            *extra]


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory, tiny_model_factory):
    """Run 1 trains 2 steps; every local folder goes (the driver's, each node's TMPDIR); run 2, a fresh
    driver with resume=true, trains to step 4. The bucket after each run, the nodes' temp files, the
    drivers' output."""
    if not namespaces_work():
        pytest.skip("needs unshare (user, network, PID and mount namespaces): on a machine with a network, "
                    "`ray start --node-ip-address=127.0.0.1` cannot keep a second node on loopback")
    out = tmp_path_factory.mktemp("multinode")
    model = tiny_model_factory("qwen3")
    spec = out / "spec.json"
    spec.write_text(json.dumps([job(model, 2, "eval.after=true"), job(model, 4, "resume=true")]))
    harness = f"{sys.executable} -c \"{LOOPBACK_UP}\" && exec {sys.executable} {ROOT / 'tests' / 'multinode_cluster.py'} " \
              f"{out} {spec}"
    start = time.monotonic()
    proc = subprocess.run([*ISOLATE, "bash", "-c", harness], cwd=ROOT, capture_output=True, text=True, timeout=900)
    seconds = time.monotonic() - start
    logs = {i: (out / f"driver{i}.log").read_text() if (out / f"driver{i}.log").is_file() else "" for i in (1, 2)}
    results = json.loads((out / "results.json").read_text()) if (out / "results.json").is_file() else []
    assert proc.returncode == 0 and [r["returncode"] for r in results] == [0, 0], \
        f"harness {proc.returncode}, runs {results}\n{proc.stderr[-3000:]}\n{logs[1][-4000:]}\n{logs[2][-4000:]}"
    print(f"two runs on two nodes: {seconds:.0f} s ({results})")
    return out, logs


def bucket_file(out: Path, run: int, key: str) -> Path:
    return out / f"bucket{run}" / key


def traces(out: Path, run: int) -> list[dict]:
    parts = sorted((out / f"bucket{run}" / "run" / "traces").glob("part-*.parquet"))
    return [row for p in parts for row in pq.read_table(p, columns=["group_id", "policy_version"]).to_pylist()]


@pytest.mark.slow
@pytest.mark.timeout(1000)  # its own subprocess limits are longer than the suite's per-test timeout
def test_a_run_on_two_nodes_writes_checkpoints_traces_and_state_to_the_bucket(two_runs):
    # Catches: a run whose checkpoints, driver state or traces land on some node's disk instead of the
    # storage root, a checkpoint without its marker, and actors that open the model where another node
    # put it. Each node's TMPDIR is a tmpfs only that node's processes see. Planted: RolloutWorker
    # building its engine from ``model.path`` (the warm start's folder, on the head) instead of
    # local_folder(model), run 1 fails on node b (FileNotFoundError: model path .../a/tmp/...);
    # the warm start run in the driver process, the head has no copy of its checkpoint. And (issue 36) a
    # learner whose rank 1 runs on node b: each rank uploads its own shard of the optimizer state from its
    # node, and the manifest lists every rank's. Planted: LearnerActor.save_checkpoint uploading on rank 0
    # only, the checkpoints lack __1_0.distcp, fail their manifest check, and run 2 finds none to resume.
    out, _ = two_runs
    ckpt = bucket_file(out, 1, "run/checkpoints/step_000002")
    assert CKPT_FILES | SHARD_FILES <= {p.name for p in ckpt.iterdir()}
    for name, entry in json.loads((ckpt / "manifest.json").read_text())["files"].items():
        assert hashlib.sha256((ckpt / name).read_bytes()).hexdigest() == entry["sha256"], name
    state = json.loads(bucket_file(out, 1, "run/driver_state.json").read_text())
    assert state["step"] == 2 and len(state["ledger"]["trained"]) == 2 * GROUPS
    assert len(traces(out, 1)) == 2 * GROUPS * SAMPLES  # sync: exactly the trained groups, read by pyarrow
    assert bucket_file(out, 1, "run/config.yaml").is_file()
    assert [json.loads(line)["step"] for line in bucket_file(out, 1, "run/metrics.jsonl").read_text().splitlines()] == [1, 2]
    # the evaluation's rows reach the bucket with the driver's other files (planted: EVAL_DIR left out of
    # push_driver_files, they stay in the driver's temporary folder, which is deleted)
    rows = [json.loads(line) for line in bucket_file(out, 1, "run/eval/after.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and {r["version"] for r in rows} == {state["version"]}
    node_a, node_b = (out / "node_a1.txt").read_text().split(), (out / "node_b1.txt").read_text().split()
    # the warm start's checkpoint on the head, and node b's own copy of it, written from the object store
    assert any(p.startswith("./sliderl-warmstart/sft-") and p.endswith("/model.safetensors") for p in node_a), node_a
    assert any(p.startswith("./sliderl-models/") and p.endswith("/model.safetensors") for p in node_b), node_b


@pytest.mark.slow
@pytest.mark.timeout(1000)
def test_the_warm_start_runs_on_its_actor_and_is_cached_in_the_bucket(two_runs):
    # Catches: the warm start trained in the driver process (as it was), its checkpoint left on the
    # node that trained it, and a second run training it again although the bucket holds it (the
    # head's copy is deleted between the runs). Planted: initial_model calling cached_warm_start in
    # the driver, the SFT lines carry no "(WarmStartActor" prefix.
    out, logs = two_runs
    sft_lines = [line for line in logs[1].splitlines() if "sft step " in line]
    assert len(sft_lines) == 3 and all("(WarmStartActor" in line for line in sft_lines), logs[1][-3000:]
    markers = list((out / "bucket1" / "warmstart").glob("sft-*/sft.json"))
    assert len(markers) == 1 and (markers[0].parent / "model.safetensors").is_file()
    assert "sft step " not in logs[2]  # cached: found in the bucket, not trained again
    again = out / "bucket2" / markers[0].relative_to(out / "bucket1")
    assert again.read_bytes() == markers[0].read_bytes()


@pytest.mark.slow
@pytest.mark.timeout(1000)
def test_a_fresh_driver_resumes_from_the_bucket_alone(two_runs):
    # Catches: a resume that needs the first driver's disk (checkpoints, trace log, metrics or data
    # cursor read from a local folder), one that restarts the learner from the initial weights, or
    # that rewrites the traces already logged. Everything local went between the runs (the
    # driver's tmpfs, each node's TMPDIR). Planted: resume=true looking for checkpoints in a local
    # folder, run 2 exits 2 ("holds no complete, intact checkpoint"); LearnerActor ignoring a URI
    # checkpoint (starting from the model), step 3's groups are sampled at version 0, not 2; TraceLog
    # numbering from 0 on a URI, run 1's part-000000 is overwritten; no metrics.jsonl copied back on
    # resume, the bucket's metrics hold steps [3, 4].
    out, _ = two_runs
    first = json.loads(bucket_file(out, 1, "run/driver_state.json").read_text())
    second = json.loads(bucket_file(out, 2, "run/driver_state.json").read_text())
    assert second["step"] == 4 and second["version"] >= first["version"]
    assert second["ledger"]["trained"][:2 * GROUPS] == first["ledger"]["trained"]  # the checkpoint's books
    assert second["cursor"] == 4 * GROUPS and len(set(second["ledger"]["trained"])) == 4 * GROUPS
    assert (bucket_file(out, 2, "run/checkpoints/step_000004/COMPLETE")).is_file()
    metrics = bucket_file(out, 2, "run/metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in metrics] == [1, 2, 3, 4]
    old_parts = sorted((out / "bucket1" / "run" / "traces").glob("part-*.parquet"))
    for part in old_parts:  # appended after, never rewritten
        assert (out / "bucket2" / "run" / "traces" / part.name).read_bytes() == part.read_bytes()
    rows = traces(out, 2)
    assert len(rows) == 4 * GROUPS * SAMPLES
    resumed = [r for r in rows if r["group_id"] in second["ledger"]["trained"][2 * GROUPS:3 * GROUPS]]
    assert {r["policy_version"] for r in resumed} == {first["version"]}  # step 3 sampled with the checkpoint's weights
