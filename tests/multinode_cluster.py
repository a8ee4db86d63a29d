"""A two-node Ray cluster on 127.0.0.1 and an S3 server (moto), then ``sliderl train`` runs against them.

Run by ``tests/test_multinode.py`` inside private user, network, PID and mount namespaces, where
loopback is the only network (so ``ray start`` keeps every node on 127.0.0.1, and nothing here can
reach or be reached from the machine's other processes). It starts:

- moto's S3 server on 127.0.0.1 and the bucket ``sliderl``;
- a Ray head (1 CPU, custom resource ``node_a``) and a second node (2 CPUs, ``node_b``), each with
  its own Ray temp dir and, in a mount namespace of its own, its own ``TMPDIR`` on a tmpfs no other
  node sees (so what one node writes there is not on any other node's disk); token authentication
  on, the S3 endpoint and credentials in every node's environment;

then, for each run of ``SPEC_JSON`` (a list of override lists), a driver on the head whose own
``TMPDIR`` is a tmpfs of its own mount namespace. After each run it copies the whole bucket (with
boto3) to ``OUT/bucket<i>/``, lists each node's ``TMPDIR`` into ``OUT/node_<name><i>.txt`` and
deletes it; the driver's tmpfs is gone with its namespace. Nodes and moto are stopped by their pids.

    python tests/multinode_cluster.py OUT SPEC_JSON
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BUCKET = "sliderl"
ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
WAIT_S = 180
STARTED = "Ray runtime started."  # what `ray start` prints once its node has joined the cluster


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(ready, proc: subprocess.Popen, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not ready():
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} was not ready within {WAIT_S} s")
        time.sleep(0.2)


def listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


class Node:
    """``ray start --block`` (it stops the node's processes on SIGTERM) with its own Ray temp dir and a
    private TMPDIR: a tmpfs mounted in the node's own mount namespace, inherited by every process of it."""

    def __init__(self, name: str, base: Path, env: dict, *args: str):
        self.name, self.dir = name, base / name
        self.tmp = self.dir / "tmp"
        self.tmp.mkdir(parents=True)
        self.log = self.dir / "out.log"
        start = [str(BIN / "ray"), "start", "--block", "--node-ip-address=127.0.0.1", "--disable-usage-stats",
                 f"--temp-dir={self.dir / 'ray'}", f"--dashboard-agent-listen-port={free_port()}",
                 f"--ray-client-server-port={free_port()}", f"--metrics-export-port={free_port()}", *args]
        script = f'mount -t tmpfs tmpfs {self.tmp} && exec "$@"'
        self.proc = subprocess.Popen(["unshare", "--mount", "bash", "-c", script, name, *start],
                                     env={**env, "TMPDIR": str(self.tmp)}, stdout=self.log.open("w"),
                                     stderr=subprocess.STDOUT)

    def started(self) -> bool:
        return self.log.is_file() and STARTED in self.log.read_text(errors="replace")

    def in_namespace(self, command: str) -> str:
        """Run ``command`` (bash) in this node's mount namespace; its output."""
        return subprocess.run(["nsenter", f"--target={self.proc.pid}", "--mount", "bash", "-c", command],
                              capture_output=True, text=True, check=True).stdout

    def empty_tmp(self, listing: Path) -> None:
        """Record what the node's processes left in its TMPDIR, then delete it all."""
        listing.write_text(self.in_namespace(f"cd {self.tmp} && find . -mindepth 1 | sort"))
        self.in_namespace(f"find {self.tmp} -mindepth 1 -delete")


def run_driver(index: int, base: Path, overrides: list[str], env: dict, out: Path) -> dict:
    """``sliderl train`` on the head, its TMPDIR (the driver's own folder) on a tmpfs of its own."""
    disk = base / f"driver{index}"
    disk.mkdir()
    script = f'mount -t tmpfs tmpfs {disk} && TMPDIR={disk} exec {sys.executable} -m sliderl.cluster.cli train "$@"'
    start = time.monotonic()
    with (out / f"driver{index}.log").open("w") as log:
        code = subprocess.run(["unshare", "--mount", "bash", "-c", script, "driver", *overrides], env=env, cwd=ROOT,
                              stdout=log, stderr=subprocess.STDOUT, timeout=600).returncode
    disk.rmdir()  # the tmpfs went with the driver's namespace: nothing of the run is left on its disk
    return {"returncode": code, "seconds": round(time.monotonic() - start, 1)}


def copy_bucket(endpoint: str, dest: Path) -> None:
    import boto3

    s3 = boto3.client("s3", endpoint_url=endpoint)
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET):
        for item in page.get("Contents", []):
            if item["Key"].endswith("/"):  # an empty folder's marker, as pyarrow leaves them
                continue
            target = dest / item["Key"]
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(s3.get_object(Bucket=BUCKET, Key=item["Key"])["Body"].read())


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main(out: Path, spec: Path) -> None:
    runs = json.loads(spec.read_text())
    base = Path(tempfile.mkdtemp(prefix="mn", dir="/tmp"))  # short: Ray's socket paths must fit 107 bytes
    moto_port, gcs = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "AWS_"))}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT), RAY_AUTH_MODE="token",
               RAY_AUTH_TOKEN=secrets.token_hex(16), AWS_ENDPOINT_URL=f"http://127.0.0.1:{moto_port}",
               AWS_ACCESS_KEY_ID="sliderl", AWS_SECRET_ACCESS_KEY="sliderl", AWS_DEFAULT_REGION="us-east-1")
    moto = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(moto_port)], env=env,
                            stdout=(out / "moto.log").open("w"), stderr=subprocess.STDOUT)
    nodes: list[Node] = []
    results = []
    try:
        nodes.append(Node("a", base, env, "--head", f"--port={gcs}", "--num-cpus=1", '--resources={"node_a": 1}',
                          "--include-dashboard=false"))
        wait_until(lambda: listening(moto_port), moto, "moto")
        import boto3

        boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], region_name="us-east-1", aws_access_key_id="sliderl",
                     aws_secret_access_key="sliderl").create_bucket(Bucket=BUCKET)
        wait_until(lambda: listening(gcs), nodes[0].proc, "the Ray head")
        nodes.append(Node("b", base, env, f"--address=127.0.0.1:{gcs}", "--num-cpus=2", '--resources={"node_b": 8}'))
        for node in nodes:
            wait_until(node.started, node.proc, f"Ray node {node.name}")
        os.environ.update(env)  # boto3 below reads the endpoint's credentials
        for i, overrides in enumerate(runs, 1):
            results.append(run_driver(i, base, overrides, {**env, "RAY_ADDRESS": f"127.0.0.1:{gcs}"}, out))
            copy_bucket(env["AWS_ENDPOINT_URL"], out / f"bucket{i}")
            for node in nodes:
                node.empty_tmp(out / f"node_{node.name}{i}.txt")
            if results[-1]["returncode"] != 0:
                break
    finally:
        for proc in [node.proc for node in reversed(nodes)] + [moto]:
            stop(proc)
        (out / "results.json").write_text(json.dumps(results))
        for node in nodes:
            shutil.copy(node.log, out / f"ray_{node.name}.log")
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
