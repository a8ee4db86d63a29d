"""The Ray dashboard shows a live sliderl run: actor names by role, the job's metadata, the metrics.

The first tests check the names and the metadata without Ray. The ``browser`` tests (run with
``-m browser``; they skip only when no Chromium is installed) start a real Ray head on 127.0.0.1
with its dashboard and Ray's token authentication, submit a short ``sliderl train`` job with
``ray job submit --metadata-json "$(sliderl job-metadata ...)"``, and while it trains they log in to
the dashboard in headless Chromium with the token (typed into the dashboard's own token dialog, as a
user would), read the rendered Jobs, job and Actors pages, take screenshots, and scrape the head's
Prometheus endpoint. Then the job is stopped and the head with it (by its pid).

Refresh the screenshots in the docs with
``SLIDERL_DASHBOARD_SHOTS=docs/figures/dashboard python -m pytest -m browser tests/test_dashboard.py``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml
from headless_browser import Browser, chromium_path
from multinode_cluster import free_port, listening

from sliderl.cluster.actors.placement import connect
from sliderl.cluster.cli import main
from sliderl.cluster.config.base import load_config
from sliderl.cluster.config.train import TrainConfig
from sliderl.cluster.observe.dashboard import job_metadata, run_label, run_name, warn_if_submitted_without_metadata

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
SUBMISSION = "sliderl-dashboard-test"
TOKEN_DIALOG = "Authentication Token Required"  # the dashboard's dialog when a request lacks the token
LIVE_S = 240  # for the job to start its actors and for each page to show up (2 shared cores can be slow)
HTTP_S = 90  # for one answer of the dashboard or the metrics endpoint (its processes share 2 busy cores)
METRICS_S = 60  # for every metric to reach the head's endpoint once the run steps (reported every 0.5 s)
# every metric sliderl exports, as Prometheus names them (docs/guide.md, sliderl/cluster/observe/ray_metrics.py); one prefix
SERIES = {"ray_sliderl_rollout_tokens_per_s", "ray_sliderl_visible_kv_tokens", "ray_sliderl_reward",
          "ray_sliderl_learner_step_seconds_count", "ray_sliderl_staleness_versions", "ray_sliderl_queue_depth",
          "ray_sliderl_weight_sync_seconds_count", "ray_sliderl_learner_steps_total"}


# ------------------------------------------------------------------------ names and metadata


def test_run_label_is_one_per_storage_root(tmp_path, monkeypatch):
    # Catches: actor names that change between drivers of one run (a resume could not find its actors by
    # name, a restarted worker would be listed under a new one) or that are the same for two runs whose
    # folders share a name (two runs on one cluster shown as one). Planted by dropping the hash from
    # run_label, the two "smoke" folders get one label and this fails.
    monkeypatch.chdir(tmp_path)
    label = run_label("runs/smoke")
    digest = hashlib.sha256(str(tmp_path.resolve() / "runs" / "smoke").encode()).hexdigest()[:6]
    assert label == f"smoke-{digest}"  # the run name, then 6 hex digits of the absolute root
    assert run_label(str(tmp_path / "runs" / "smoke")) == run_label("./runs/../runs/smoke") == label
    other = str(tmp_path / "other" / "smoke")
    assert run_label(other) != label and run_name(other) == "smoke"
    uri = "s3://bucket/exp/run1"
    assert run_label(f"{uri}?endpoint_override=10.0.0.5:9000") == run_label(f"{uri}/") == run_label(uri)
    assert run_label(uri) == f"run1-{hashlib.sha256(uri.encode()).hexdigest()[:6]}"


def test_job_metadata_command_prints_the_runs_metadata(tmp_path, capsys):
    # Catches: metadata that does not describe the job it is submitted with (the KV policy, model or run
    # of another config; a commit of nothing) or that Ray refuses (a value that is not a string). The
    # expected values are read from configs/smoke.yaml with yaml and from git itself. Planted by reading
    # the KV policy from the default recipe instead of the config, this fails.
    run_dir, config = tmp_path / "runs" / "smoke", str(ROOT / "configs" / "smoke.yaml")
    assert main(["job-metadata", config, f"run_dir={run_dir}", "learner.algo.type=bonbon",
                 "learner.algo.speedup_key=null"]) == 0
    metadata = json.loads(capsys.readouterr().out)
    recipe = yaml.safe_load((ROOT / "configs" / "smoke.yaml").read_text())
    assert all(isinstance(v, str) for v in metadata.values()), metadata
    assert metadata["job_name"] == run_label(str(run_dir)) and metadata["sliderl_run"] == "smoke"
    assert metadata["sliderl_run_dir"] == str(run_dir) and metadata["sliderl_config"] == config
    assert metadata["sliderl_kv_policy"] == recipe["engine"]["kv"] == "prefix_sliding:8"
    assert metadata["sliderl_algo"] == "bonbon"
    assert metadata["sliderl_model"].startswith(f"tiny {recipe['model']['arch']} (")
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode == 0:
        assert head.stdout.strip().startswith(metadata["sliderl_commit"].removesuffix("-dirty"))
    cfg = load_config(TrainConfig, None, [f"run_dir={run_dir}"])
    assert main(["job-metadata", f"run_dir={run_dir}"]) == 0
    assert json.loads(capsys.readouterr().out)["sliderl_kv_policy"] == cfg.engine.kv  # the default recipe's


def test_a_job_submitted_without_the_metadata_says_how_to_add_it(monkeypatch, capsys):
    # Catches: a submitted job whose Jobs page shows nothing of the run, silently. The variable is the one
    # Ray sets in a submitted job's entrypoint (its submission's metadata inside). Planted by returning
    # early from warn_if_submitted_without_metadata, the first check fails.
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", '{"metadata": {"job_submission_id": "raysubmit_1"}}')
    warn_if_submitted_without_metadata()
    assert "--metadata-json \"$(sliderl job-metadata CONFIG" in capsys.readouterr().err
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", '{"metadata": {"sliderl_run": "smoke"}}')
    warn_if_submitted_without_metadata()
    monkeypatch.delenv("RAY_JOB_CONFIG_JSON_ENV_VAR")  # not a submitted job
    warn_if_submitted_without_metadata()
    assert capsys.readouterr().err == ""


def test_a_driver_sliderl_starts_carries_the_job_metadata(tmp_path):
    # Catches: metadata worked out but never handed to ray.init, so a run started by `sliderl train` itself
    # (no `ray job submit`) has no Name or metadata on the Jobs page. Read back from the GCS job table, which
    # the Jobs page lists such driver jobs from. Planted by dropping job_config from connect, this fails.
    import ray

    cfg = load_config(TrainConfig, str(ROOT / "configs" / "smoke.yaml"),
                      [f"run_dir={tmp_path / 'runs' / 'smoke'}", "ray.num_cpus=1", "monitor.include_dashboard=false"])
    metadata = job_metadata(cfg, "configs/smoke.yaml")
    assert connect(cfg, metadata)  # a new local instance
    try:
        job_id = ray.get_runtime_context().get_job_id()
        table = {key.hex(): dict(entry.config.metadata)
                 for key, entry in ray._private.worker.global_worker.gcs_client.get_all_job_info().items()}
    finally:
        ray.shutdown()
    assert table[job_id] == metadata and metadata["job_name"] == run_label(str(tmp_path / "runs" / "smoke"))


def test_a_second_local_run_takes_the_next_free_dashboard_port(tmp_path, capsys):
    # Catches: two local runs on one machine (seeds side by side) where the second one's Ray fails to start
    # because the first one's dashboard holds monitor.dashboard_port (it happened to benchmarks/pasta_seeds.py:
    # "Failed to find a valid port for dashboard after 0 retries"). A listening socket stands in for the
    # first dashboard; Ray must start and its dashboard answer on another port. Planted by handing the
    # configured port to Ray unchanged (free_dashboard_port dropped from connect), ray.init raises.
    import socket

    import ray

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    cfg = load_config(TrainConfig, str(ROOT / "configs" / "smoke.yaml"),
                      [f"run_dir={tmp_path / 'run'}", "ray.num_cpus=1", f"monitor.dashboard_port={port}"])
    try:
        assert connect(cfg)
        try:
            url = ray._private.worker.global_worker.node.webui_url  # host:port of the dashboard Ray started
        finally:
            ray.shutdown()
    finally:
        taken.close()
    used = int(url.rsplit(":", 1)[1])
    said = capsys.readouterr().out
    assert used != port and f"port {port} on 127.0.0.1 is in use" in said and f"listens on {used}" in said


# ------------------------------------------------------------------------------ the live run


class Head:
    """``ray start --head --block`` on 127.0.0.1 with the dashboard, on free ports and its own temp dir; stopped
    by its pid (``--block`` stops the node's processes on SIGTERM)."""

    def __init__(self, base: Path, env: dict):
        self.dashboard, self.metrics = free_port(), free_port()
        self.log = base / "head.log"
        command = [str(BIN / "ray"), "start", "--head", "--block", "--node-ip-address=127.0.0.1",
                   f"--port={free_port()}", "--num-cpus=2", "--include-dashboard=true", "--dashboard-host=127.0.0.1",
                   f"--dashboard-port={self.dashboard}", f"--metrics-export-port={self.metrics}",
                   f"--dashboard-agent-listen-port={free_port()}", f"--ray-client-server-port={free_port()}",
                   f"--temp-dir={base / 'ray'}", "--disable-usage-stats"]
        self.proc = subprocess.Popen(command, env=env, cwd=base, stdout=self.log.open("w"), stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{self.dashboard}"
        deadline = time.monotonic() + LIVE_S
        while not (listening(self.dashboard) and "Ray runtime started." in self.log.read_text(errors="replace")):
            assert self.proc.poll() is None and time.monotonic() < deadline, self.log.read_text()[-3000:]
            time.sleep(0.3)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@dataclass
class Seen:
    """What the live run showed."""

    label: str
    metadata: dict
    unauthenticated_status: int = 0  # the Jobs API's answer to a request without the token
    asked_for_token: bool = False  # the dashboard opened its token dialog before the login
    pages: dict[str, str] = field(default_factory=dict)  # page -> rendered text
    shots: dict[str, Path] = field(default_factory=dict)
    metrics: str = ""  # the head's Prometheus text once every sliderl series was there
    job_log: str = ""  # the end of the job's log after the scrape


def api(head: Head, path: str, token: str | None):
    request = urllib.request.Request(head.url + path, headers={"Authorization": f"Bearer {token}"} if token else {})
    with urllib.request.urlopen(request, timeout=HTTP_S) as answer:
        return json.load(answer)


def wait_for_actors(head: Head, token: str, classes: set[str]) -> None:
    """Until an actor of every class in ``classes`` is ALIVE (the job has started its run; found by class, so
    that unnamed actors fail the tests, not this wait); the job's log if it ends first."""
    deadline = time.monotonic() + LIVE_S
    while True:
        job = api(head, f"/api/jobs/{SUBMISSION}", token)
        assert job["status"] in ("PENDING", "RUNNING"), api(head, f"/api/jobs/{SUBMISSION}/logs", token)["logs"][-4000:]
        actors = api(head, "/api/v0/actors?limit=1000", token)["data"]["result"]["result"]
        alive = {a["class_name"] for a in actors if a["state"] == "ALIVE"}
        if classes <= alive:
            return
        assert time.monotonic() < deadline, (alive, api(head, f"/api/jobs/{SUBMISSION}/logs", token)["logs"][-4000:])
        time.sleep(1)


def log_in(browser: Browser, head: Head, token: str) -> bool:
    """Open the dashboard; when it asks for the token, type it into its dialog and submit (the dashboard then
    keeps it in its HttpOnly cookie and reloads). True when it asked."""
    browser.open(head.url + "/")
    text = browser.wait_for_text_any(TOKEN_DIALOG, "Recent jobs", timeout_s=LIVE_S)
    if TOKEN_DIALOG not in text:
        return False
    browser.call("Runtime.evaluate", {"expression": "document.querySelector('[role=dialog] input').focus()"})
    browser.call("Input.insertText", {"text": token})
    assert browser.click_text("Submit"), "the token dialog has no Submit button"
    deadline = time.monotonic() + LIVE_S
    while TOKEN_DIALOG in browser.text():
        assert time.monotonic() < deadline, "the dashboard did not accept the token"
        time.sleep(0.5)
    return True


def scrape_until(port: int, names: set[str]) -> str:
    """The Prometheus text of the head's metrics endpoint once it holds every series in ``names`` (or after
    METRICS_S). A gauge leaves the endpoint once its process ends, so this reads a run that still trains."""
    deadline = time.monotonic() + METRICS_S
    while True:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=HTTP_S) as answer:
            text = answer.read().decode()
        if names <= series_names(text) or time.monotonic() > deadline:
            return text
        time.sleep(1)


def series_names(text: str) -> set[str]:
    return {m.group(1) for m in re.finditer(r"^([A-Za-z_:][\w:]*)(?:\{|\s)", text, re.M)}


@pytest.fixture(scope="module")
def live_run():
    if chromium_path() is None:
        pytest.skip("Chromium is not installed (Debian: apt-get install chromium); the dashboard test drives a "
                    "real headless browser")
    base = Path(tempfile.mkdtemp(prefix="dash", dir="/tmp"))  # short: Ray's socket paths must fit 107 bytes
    token = secrets.token_hex(16)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token, RAY_metrics_report_interval_ms="500",
               RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",  # every port of the head on 127.0.0.1 (cluster.actors.placement)
               PYTHONPATH=str(ROOT), PATH=f"{BIN}:{env.get('PATH', '')}", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    run_dir = base / "runs" / "smoke"
    args = [str(ROOT / "configs" / "smoke.yaml"), f"run_dir={run_dir}", "train.steps=100000", "checkpoint.every=0",
            "monitor.wandb.mode=disabled", "warmstart.enabled=true", "warmstart.sft.steps=2",
            "warmstart.sft.batch_size=4", f"warmstart.cache_dir={base / 'warmstart'}"]
    head = Head(base, env)
    try:
        metadata = subprocess.run(["sliderl", "job-metadata", *args], env=env, capture_output=True, text=True,
                                  check=True).stdout
        subprocess.run(["ray", "job", "submit", "--no-wait", f"--address={head.url}", f"--submission-id={SUBMISSION}",
                        f"--metadata-json={metadata}", "--", "sliderl", "train", *args], env=env, check=True,
                       capture_output=True)
        seen = Seen(run_label(str(run_dir)), json.loads(metadata))
        try:
            api(head, "/api/jobs/", None)
        except urllib.error.HTTPError as err:
            seen.unauthenticated_status = err.code
        wait_for_actors(head, token, {"LearnerActor", "RolloutWorker"})
        observe(seen, head, token, base)
        seen.metrics = scrape_until(head.metrics, SERIES)
        seen.job_log = api(head, f"/api/jobs/{SUBMISSION}/logs", token)["logs"][-3000:]
        subprocess.run(["ray", "job", "stop", f"--address={head.url}", SUBMISSION], env=env, check=True,
                       capture_output=True, timeout=300)
        yield seen
    finally:
        head.stop()
        shutil.rmtree(base, ignore_errors=True)


def observe(seen: Seen, head: Head, token: str, base: Path) -> None:
    """Log in, then read (and screenshot) the Jobs page, the job's page and the Actors page."""
    shots = Path(os.environ.get("SLIDERL_DASHBOARD_SHOTS", base / "shots"))
    with Browser(base / "chromium") as browser:
        seen.asked_for_token = log_in(browser, head, token)
        browser.open(f"{head.url}/#/jobs")
        seen.pages["jobs"] = browser.wait_for_text(SUBMISSION, "RUNNING", timeout_s=LIVE_S)
        browser.poll_text(("Fetched jobs",), timeout_s=15)  # the page refreshes itself: shoot between two loads
        seen.shots["jobs"] = browser.screenshot(shots / "jobs.png")
        browser.open(f"{head.url}/#/jobs/{SUBMISSION}")
        seen.pages["job"] = browser.wait_for_text("User-provided metadata", "Ray Core Overview", timeout_s=LIVE_S)
        if browser.click_text("Expand", near="User-provided metadata"):  # the whole JSON in the screenshot
            time.sleep(1)
        seen.shots["job"] = browser.screenshot(shots / "job.png")
        browser.open(f"{head.url}/#/actors")
        seen.pages["actors"] = browser.wait_for_text("LearnerActor", "RolloutWorker", "WarmStartActor",
                                                     timeout_s=LIVE_S)
        seen.shots["actors"] = browser.screenshot(shots / "actors.png")


@pytest.mark.browser
def test_the_dashboard_asks_for_rays_token(live_run):
    # Catches: a cluster (or a test) running without Ray's token authentication, where the checks below
    # would pass without a token. Planted by starting the head with RAY_AUTH_MODE=disabled, both fail.
    assert live_run.unauthenticated_status == 401
    assert live_run.asked_for_token
    assert all(TOKEN_DIALOG not in text for text in live_run.pages.values())  # and the token was accepted


@pytest.mark.browser
def test_jobs_page_shows_the_run_with_its_metadata(live_run):
    # Catches: a job without sliderl's metadata (no Name on the Jobs page, no run, config or KV policy on
    # the job's page), or metadata of another run. Planted by dropping job_name from job_metadata, the
    # label is missing from the Jobs page; by submitting without --metadata-json, this fails too.
    jobs = live_run.pages["jobs"]
    row = next(line for line in jobs.splitlines() if SUBMISSION in line)
    assert live_run.label in row and live_run.label.startswith("smoke-")  # the Name column, in the job's row
    job = live_run.pages["job"]
    shown = json.loads(re.search(r"User-provided metadata\s*(\{.*?\})", job, re.S).group(1))
    assert shown == live_run.metadata
    assert shown["sliderl_kv_policy"] == "prefix_sliding:8" and shown["sliderl_run"] == "smoke"
    assert shown["sliderl_config"].endswith("configs/smoke.yaml") and shown["sliderl_commit"] != "unknown"


@pytest.mark.browser
def test_actors_page_shows_the_runs_actors_by_role(live_run):
    # Catches: unnamed actors (the Actors page lists them only by class and id) or names that do not say
    # whose run they belong to. Planted by dropping "name" from cluster.actors.placement.actor_options, the learner
    # and rollout worker are missing here (and the fixture's wait for them by name times out).
    actors = live_run.pages["actors"]
    for role in ("learner", "rollout-0", "trace-queue", "warm-start"):  # the warm start's actor is DEAD by now
        assert f"{live_run.label}/{role}" in actors, (role, actors[:3000])


@pytest.mark.browser
def test_live_run_exports_every_sliderl_metric_under_one_prefix(live_run):
    # Catches: a metric exported under another prefix (a dashboard panel or alert on ray_sliderl_* misses
    # it), a role that records nothing in a real run, or a Grafana panel on a series a run never exports.
    # Planted by renaming sliderl_queue_depth to queue_depth in sliderl/cluster/observe/ray_metrics.py, this fails.
    from test_metrics import dashboard_series

    names = series_names(live_run.metrics)
    assert SERIES <= names, (SERIES - names, live_run.job_log)
    ours = {n for n in names if "sliderl" in n}
    assert all(n.startswith("ray_sliderl_") for n in ours), ours
    assert dashboard_series() <= names, dashboard_series() - names
    rollout = re.search(r'^ray_sliderl_rollout_tokens_per_s\{[^}]*role="rollout"[^}]*worker_id="0"[^}]*\} (\S+)',
                        live_run.metrics, re.M)
    assert rollout and float(rollout.group(1)) > 0


@pytest.mark.browser
def test_screenshots_are_small_pngs(live_run):
    # Catches: screenshots the docs cannot carry (not a PNG, or over the ~300 KB the repository allows one).
    for path in live_run.shots.values():
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size < 300_000, path
