"""Which addresses a local run listens on: every Ray port of a run sliderl starts itself is on loopback.

While a real `sliderl train` runs (a local Ray with the dashboard, a learner and a rollout worker,
W&B offline) the test lists, every fraction of a second, the listening TCP sockets of the run's
process tree (the CLI, the GCS, the raylet and the processes they start) from /proc, and fails on
any that is not bound to a loopback address. The allowlist is empty: with its node IP set to
127.0.0.1 (``cluster.actors.placement.start_local_ray``) Ray binds every port it opens to it.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from cluster_jobs import tiny_overrides

ROOT = Path(__file__).resolve().parents[1]
# process name fragment -> why Ray gives no way to bind its listener to loopback (also in docs/guide.md, "Network exposure").
# Empty: nothing needs it.
ALLOWLIST: dict[str, str] = {}


def tcp_listeners() -> dict[int, tuple[str, int]]:
    """Socket inode -> (address, port) of every TCP socket of this network namespace in LISTEN state."""
    found = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            continue
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A":  # TCP_LISTEN
                continue
            hex_ip, hex_port = fields[1].split(":")
            raw = bytes.fromhex(hex_ip)  # the kernel prints each 32-bit word in host (little-endian) order
            words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            family = socket.AF_INET if len(raw) == 4 else socket.AF_INET6
            found[int(fields[9])] = (socket.inet_ntop(family, words), int(hex_port, 16))
    return found


def process_tree(root: int) -> list[int]:
    """``root`` and every process descended from it (by parent pid)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:  # exited meanwhile
                continue
            children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, []))
    return tree


def listening(pids: list[int]) -> set[tuple[str, str, int]]:
    """(process name, address, port) of each listening TCP socket held by one of ``pids``."""
    listeners = tcp_listeners()
    held = set()
    for pid in pids:
        try:
            name = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:100]
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:[") and int(link[8:-1]) in listeners:
                held.add((name.strip(), *listeners[int(link[8:-1])]))
    return held


def is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped  # "::ffff:127.0.0.1": an IPv6 socket bound to the IPv4 loopback address
    return ip.is_loopback


def test_is_loopback_reads_the_kernel_forms():
    # Catches a loopback check that lets "::" (every interface, IPv4 too) or "0.0.0.0" through, or
    # that rejects the IPv4-mapped loopback form Ray's gRPC servers use.
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("::ffff:127.0.0.1")
    assert not is_loopback("0.0.0.0") and not is_loopback("::") and not is_loopback("192.0.2.2")


def test_a_local_run_listens_on_loopback_only(tiny_model_factory, tmp_path):
    # Catches (issue 11, bug 8): a local run whose Ray ports (GCS, raylet, object manager, core
    # workers, dashboard agent, metrics endpoints) listen on every interface, where anyone on the
    # network can reach them. Planted by starting Ray with a plain ray.init(address="local") in
    # cluster.actors.placement.connect, this fails: the GCS, raylet and workers listen on "::", the metrics
    # exporters on 0.0.0.0.
    model = tiny_model_factory("qwen3")
    overrides = tiny_overrides(model, tmp_path / "run") + [
        "train.steps=3", "monitor.include_dashboard=true", f"monitor.dashboard_port={free_port()}",
        "monitor.wandb.mode=offline", "ray.num_cpus=2"]
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")}
    run = subprocess.Popen([sys.executable, "-m", "sliderl.cluster.cli", "train", *overrides], cwd=ROOT, env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen: set[tuple[str, str, int]] = set()
    deadline = time.monotonic() + 300
    while run.poll() is None and time.monotonic() < deadline:
        seen |= listening(process_tree(run.pid))
        time.sleep(0.3)  # sockets come and go with the run's processes: sample until it ends
    if run.poll() is None:
        run.kill()
    output = run.communicate()[0]
    assert run.returncode == 0, output[-3000:]
    names = " ".join(name for name, _, _ in seen)
    # the sampling really saw the run's servers (a broken walk of /proc would pass vacuously)
    assert "gcs_server" in names and "raylet" in names and "DashboardAgent" in names, sorted(seen)
    exposed = sorted((name, addr, port) for name, addr, port in seen
                     if not is_loopback(addr) and not any(fragment in name for fragment in ALLOWLIST))
    assert not exposed, "listening beyond loopback:\n" + "\n".join(map(str, exposed))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_rays_token_file_is_private_to_its_user(tmp_path, monkeypatch):
    # Catches (issue 37): Ray's auth token file written world-readable (0644) by a local run (Ray generates it
    # with the default umask) or by `ray get-auth-token --generate`: any user of the machine could read the token
    # and run code on the cluster. Before a local ray.init the file is created 0600 (Ray then reads it instead
    # of writing its own); one found readable by others is set to 0600; joining a cluster creates none (its
    # token would not be the cluster's). Planted by dropping the chmod, the 0644 file stays and this fails;
    # without the creation, Ray's own 0644 file appears at the first local run.
    import stat

    from sliderl.cluster.actors.placement import keep_auth_token_private

    for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    token = tmp_path / ".ray" / "auth_token"
    assert keep_auth_token_private(create=False) is None and not token.exists()
    assert keep_auth_token_private() == token
    assert stat.S_IMODE(token.stat().st_mode) == 0o600 and len(token.read_text()) == 64  # Ray's 256-bit hex token
    first = token.read_text()
    token.chmod(0o644)  # as `ray get-auth-token --generate` leaves it
    assert keep_auth_token_private(create=False) == token
    assert stat.S_IMODE(token.stat().st_mode) == 0o600 and token.read_text() == first
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    token.unlink()
    assert keep_auth_token_private() is None and not token.exists()


def test_processes_starting_ray_at_once_never_read_a_half_written_token(tmp_path, monkeypatch):
    # Catches: the token file created empty and filled afterwards, so a second run (or test worker) starting Ray at
    # the same moment finds it, skips creating one and hands Ray an empty token. Ray's generator is slowed to 0.2 s
    # here so the window is wide: planted by creating the file first (O_EXCL) and writing the token into it after,
    # as the code did before, the threads that find the file read "" and this fails.
    import threading
    import time

    from ray._private.authentication import authentication_token_generator as generator

    from sliderl.cluster.actors.placement import keep_auth_token_private

    for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    real = generator.generate_new_authentication_token

    def slow() -> str:
        time.sleep(0.2)
        return real()

    monkeypatch.setattr(generator, "generate_new_authentication_token", slow)
    barrier, seen = threading.Barrier(6), []

    def start() -> None:
        barrier.wait()
        seen.append(keep_auth_token_private().read_text())

    threads = [threading.Thread(target=start) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    token = (tmp_path / ".ray" / "auth_token").read_text()
    assert len(token) == 64 and seen == [token] * 6  # every caller read the one complete token
    assert [p.name for p in (tmp_path / ".ray").iterdir()] == ["auth_token"]  # no private copy left behind
