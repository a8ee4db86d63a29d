"""The docs' commands as a new user runs them: the `ray job submit` recipe exactly as written on a fresh
machine, and every `python -m` module the README and the guide name.

The recipe's lines come from the README or docs/guide.md (the bash block under the ``job-submit`` marker, in
whichever of them holds it) and run with bash in
a copy of the working tree, with a fresh HOME (the recipe generates its token into ~/.ray). The
recipe uses Ray's fixed ports and ends with ``ray stop``, which stops every Ray process it can see,
so it runs in private network, PID and mount namespaces (``unshare``): it cannot reach or stop a
cluster someone else runs on this machine, and nothing of it outlives the test. Where namespaces
are not available it runs directly, but only on a machine with no Ray running.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from cluster_jobs import metric_rows

ROOT = Path(__file__).resolve().parents[1]
DOCS = (ROOT / "README.md", ROOT / "docs" / "guide.md", ROOT / "docs" / "results.md")  # what a new user reads
BIN = Path(sys.executable).parent
MARKER = "<!-- job-submit:"
# bring up the loopback interface of a new network namespace (SIOCSIFFLAGS: IFF_UP | IFF_LOOPBACK | IFF_RUNNING)
LOOPBACK_UP = ("import fcntl, socket, struct; fcntl.ioctl(socket.socket(socket.AF_INET, socket.SOCK_DGRAM), 0x8914, "
               "struct.pack('16sH22x', b'lo', 0x1 | 0x8 | 0x40))")
ISOLATE = ["unshare", "--user", "--map-root-user", "--net", "--pid", "--fork", "--mount-proc"]
# inside the namespaces: loopback up, a private /tmp/ray (Ray's session dirs), then the recipe
PRELUDE = f"{sys.executable} -c \"{LOOPBACK_UP}\" && mkdir -p /tmp/ray && mount -t tmpfs tmpfs /tmp/ray"


def readme_recipe() -> list[str]:
    """The lines of the bash block that follows the job-submit marker (in the README or the guide), comments kept."""
    holders = [doc for doc in DOCS if MARKER in doc.read_text()]
    assert len(holders) == 1, f"the job-submit marker must be in exactly one of {[d.name for d in DOCS]}: {holders}"
    text = holders[0].read_text()
    start = text.index(MARKER)
    block = re.search(r"```bash\n(.*?)```", text[start:], re.S)
    assert block, f"no bash block after the job-submit marker in {holders[0].name}"
    return block.group(1).splitlines()


def copy_of_working_tree(dest: Path) -> Path:
    """The files git tracks or would track (what a fresh clone plus uncommitted work holds)."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True,
                           check=True).stdout.decode().split("\0")
    for name in filter(None, files):
        if (ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)
    return dest


def namespaces_work() -> bool:
    try:
        return subprocess.run([*ISOLATE, "bash", "-c", PRELUDE], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def ray_running() -> bool:
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and re.search(rb"gcs_server|raylet", Path(f"/proc/{entry}/cmdline").read_bytes()):
                return True
        except OSError:
            continue
    return False


def test_readme_job_submit_recipe_runs_as_written(tmp_path):
    # Catches (issue 11, bug 9): a docs recipe that fails as written — no head started, token
    # authentication off ("AuthenticationError ... RAY_AUTH_MODE is currently 'disabled'"), outputs
    # written into Ray's temporary copy of the working dir. Planted by dropping the
    # `ray get-auth-token --generate` line from the recipe, the job submit fails; with a relative
    # run_dir in the recipe, the job exits 2 (check_outlives_job) and nothing is written.
    lines = readme_recipe()
    assert any(line.startswith("ray job submit") for line in lines), lines
    project = copy_of_working_tree(tmp_path / "sliderl")
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(HOME=str(home), PATH=f"{BIN}:{env.get('PATH', '')}", HF_HUB_OFFLINE="1", PYTHONPATH=str(project))
    script = "set -euo pipefail\n" + "\n".join(lines) + "\n"
    if namespaces_work():
        command = [*ISOLATE, "bash", "-c", PRELUDE + " && bash -c \"$0\"", script]
    elif not ray_running():
        command = ["bash", "-c", script]
    else:
        pytest.skip("no unshare here and a Ray cluster runs on this machine: the recipe's `ray stop` would stop it")
    run = subprocess.run(command, cwd=project, env=env, capture_output=True, text=True, timeout=600)
    output = run.stdout + run.stderr
    assert run.returncode == 0 and "succeeded" in output, output[-4000:]
    run_dir = project / "runs" / "smoke"
    assert (home / ".ray" / "auth_token").is_file()  # the cluster ran with a token
    assert (run_dir / "checkpoints" / "step_000002" / "COMPLETE").is_file(), output[-3000:]
    assert list((run_dir / "traces").glob("part-*.parquet"))
    assert sorted(metric_rows(run_dir)) == [1, 2]
    assert "Started a local Ray instance" not in output  # the job joined the cluster the recipe started
    # Catches (issue 15): a recipe that submits the job without sliderl's metadata (the dashboard's Jobs page
    # then shows nothing of the run; the job says so in its log). Planted by dropping --metadata-json from
    # the recipe's submit line, this fails.
    assert "submitted without sliderl's metadata" not in output


def test_a_relative_run_dir_in_a_submitted_job_is_refused(tmp_path, monkeypatch, capsys):
    # Catches (issue 11, bug 9): a job submitted with --working-dir and a relative run_dir writing its
    # checkpoints and traces into Ray's temporary copy of the working dir, deleted when the job ends.
    # The environment variable is the one Ray sets in a submitted job's entrypoint (as seen in the
    # recipe test above). Planted by returning early from check_outlives_job, this fails.
    from sliderl.cluster.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR",
                       '{"runtime_env": {"working_dir": "gcs://_ray_pkg_0123.zip"}, "metadata": {}}')
    code = main(["train", str(ROOT / "configs" / "smoke.yaml"), "run_dir=runs/smoke"])
    err = capsys.readouterr().err
    assert code == 2 and "run_dir='runs/smoke' is relative" in err and "run_dir=$PWD/runs/smoke" in err, err
    assert not (tmp_path / "runs").exists()
    # an absolute run_dir, or a job without a working-dir copy, goes on (to the next check: none here)
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", '{"runtime_env": {}, "metadata": {}}')
    from sliderl.cluster.config.base import check_outlives_job

    check_outlives_job("runs/smoke", "run_dir")
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR",
                       '{"runtime_env": {"working_dir": "gcs://_ray_pkg_0123.zip"}, "metadata": {}}')
    check_outlives_job(str(tmp_path / "runs" / "smoke"), "run_dir")


def test_every_python_m_module_the_docs_name_exists_and_runs_as_a_script():
    # Catches (issue 37): a command that names a module where it no longer lives (`python -m core.tiny`, written
    # before the packages moved under sliderl/). Planted by writing `python -m core.tiny` back into
    # docs/guide.md, or by deleting the `__main__` block of sliderl/core/tiny.py, this fails.
    names = sorted({name for doc in DOCS for name in re.findall(r"python3? -m ([A-Za-z_][\w.]*)", doc.read_text())})
    assert {"venv", "pytest", "sliderl.core.tiny"} <= set(names), names  # the README's two lines and the guide's one
    for name in names:
        try:
            spec = importlib.util.find_spec(name)
        except ModuleNotFoundError:  # its parent package does not exist
            spec = None
        assert spec is not None and spec.origin, f"`python -m {name}` in the docs: no such module"
        source = Path(spec.origin)
        if ROOT in source.parents and ".venv" not in source.parts:  # ours, not a venv's package: run as __main__
            assert '__name__ == "__main__"' in source.read_text(), f"`python -m {name}`: {source} has no __main__ block"
