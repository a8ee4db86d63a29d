"""Monitoring: metrics.jsonl, a real offline W&B run (read back from its .wandb file with a decoder
written here from the format: a 7-byte ':W&B' header, then LevelDB-log records of protobuf
``Record``s), PNG plots, the summary's numbers worked out by hand, the config section, and the Ray
custom metrics recorded inside a real actor and read back from the node's Prometheus endpoint."""

import json
import math
import struct
import time
import urllib.request
from pathlib import Path

import matplotlib.image
import pytest
from pydantic import ValidationError

from sliderl.cluster.actors.placement import start_local_ray
from sliderl.cluster.config.monitor import MonitorConfig, WandbConfig
from sliderl.cluster.observe.monitor import Monitor
from sliderl.cluster.observe.ray_metrics import LearnerMetrics, RolloutMetrics
from sliderl.cluster.records import KEYS, EvalResult, StepReport
from sliderl.cluster.storage.trace_log import TraceLog
from sliderl.core.trace import Trace
from sliderl.trainer.metrics import StepMetrics

STEPS = [  # what a driver logs at optimizer steps 1..4
    {"reward": 0.1, "accuracy": 0.25, "visible_kv": 60.0, "rollout_tokens_per_s": 1000.0,
     "learner_step_seconds": 2.0, "stale_groups_dropped": 0, "loss": 0.5},
    {"reward": 0.3, "accuracy": 0.5, "visible_kv": 62.0, "rollout_tokens_per_s": 1200.0,
     "learner_step_seconds": 1.0, "stale_groups_dropped": 2, "loss": 0.4},
    {"reward": 0.4, "accuracy": 0.5, "visible_kv": 64.0, "rollout_tokens_per_s": 1100.0,
     "learner_step_seconds": 1.5, "stale_groups_dropped": 1, "loss": 0.3},
    {"reward": 0.7, "accuracy": 0.75, "visible_kv": 66.0, "rollout_tokens_per_s": 1300.0,
     "learner_step_seconds": 1.5, "stale_groups_dropped": 0, "loss": 0.2},
]

EVAL = {"eval_after/accuracy": 0.8}


@pytest.fixture(autouse=True)
def offline_wandb(tmp_path_factory, monkeypatch):
    home = tmp_path_factory.mktemp("wandb_home")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(home))


# ------------------------------------------------------------------------ reading a .wandb file

BLOCK = 32768  # LevelDB log block; a record header is crc32c(4) length(2 LE) type(1)
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def wandb_records(path: Path):
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        room = BLOCK - pos % BLOCK
        if room < 7:  # block trailer padding
            pos += room
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:  # zero fill to the end of the block
            pos += room
            continue
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def wandb_files(run_dir: Path) -> list[Path]:
    return sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb"))


def wandb_run(path: Path) -> dict:
    """Run id, history rows, final summary, config and whether the run exited, from a .wandb file."""
    out = {"id": None, "history": [], "summary": {}, "config": {}, "exited": False}
    for record in wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            out["id"] = record.run.run_id
        if kind == "history":
            out["history"].append({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                                   for i in record.history.item})
        elif kind == "summary":
            for item in record.summary.update:
                out["summary"][item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
        elif kind in ("run", "config"):  # the run record carries the initial config
            updates = record.run.config.update if kind == "run" else record.config.update
            for item in updates:
                out["config"][item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
        elif kind == "exit":
            out["exited"] = True
    return out


def trace(i: int) -> Trace:
    return Trace(trace_id=f"t{i}", group_id="g", prompt_id="p", worker_id=0, policy_version=0,
                 kv_policy="full", prompt_token_ids=[1], completion_token_ids=[2], logprobs=[-1.0],
                 finish_reason="stop")


# ------------------------------------------------------------------------------------- tests


def test_monitor_writes_jsonl_wandb_plots_and_summary(tmp_path):
    run_dir = tmp_path / "run"
    TraceLog(run_dir).append([trace(0), trace(1), trace(2)])
    monitor = Monitor(run_dir, MonitorConfig(), total_steps=4, config_dict={"lr": 0.001, "algo": "grpo"})
    for step, metrics in enumerate(STEPS, 1):
        monitor.log(step, metrics)
    monitor.log(4, EVAL)  # a second call for the last step merges into it
    summary = monitor.finish()

    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in lines] == [1, 2, 3, 4, 4]
    for row, metrics in zip(lines, STEPS + [EVAL]):
        assert {k: row[k] for k in metrics} == metrics
        assert set(row) == set(metrics) | {"step", "elapsed_s"}
    assert [row["elapsed_s"] for row in lines] == sorted(row["elapsed_s"] for row in lines)

    [wandb_file] = wandb_files(run_dir)
    run = wandb_run(wandb_file)
    assert run["exited"]
    assert [row["_step"] for row in run["history"]] == [1, 2, 3, 4]
    for row, metrics in zip(run["history"], STEPS[:3] + [{**STEPS[3], **EVAL}]):
        assert {k: row[k] for k in metrics} == metrics
    assert run["summary"]["reward"] == 0.7 and run["summary"]["visible_kv"] == 66.0
    assert run["config"]["lr"] == 0.001 and run["config"]["algo"] == "grpo"

    for name in ("reward.png", "visible_kv.png"):
        png = run_dir / name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        height, width, channels = matplotlib.image.imread(png).shape
        assert height > 100 and width > 100 and channels in (3, 4)

    assert (run_dir / "summary.txt").read_text() == summary
    assert "4 / 4" in summary
    assert "0.1000 (step 1) -> 0.7000 (step 4)" in summary  # reward
    assert "0.2500 (step 1) -> 0.7500 (step 4)" in summary  # accuracy
    assert "63.0 tokens" in summary  # (60 + 62 + 64 + 66) / 4
    assert "1150.0 (mean" in summary  # (1000 + 1200 + 1100 + 1300) / 4
    assert "1.500 s" in summary  # (2 + 1 + 1.5 + 1.5) / 4
    assert "stale dropped    3 groups" in summary  # 0 + 2 + 1 + 0
    assert "traces           3 in" in summary
    assert monitor.finish() == summary  # idempotent


def test_monitor_resumes_on_the_same_run_dir(tmp_path):
    first = Monitor(tmp_path, MonitorConfig(), total_steps=3)
    first.log(1, {"reward": 0.1, "visible_kv": 10.0})
    first.log(2, {"reward": 0.2, "visible_kv": 20.0})
    first.finish(exit_code=1)  # the run stopped here; step 2 was not checkpointed
    elapsed_before = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])["elapsed_s"]
    torn = '{"step": 3, "rew'  # a line the crash cut short
    with open(tmp_path / "metrics.jsonl", "a") as file:
        file.write(torn)

    second = Monitor(tmp_path, MonitorConfig(), total_steps=3)
    second.log(2, {"reward": 0.25, "visible_kv": 30.0})  # replayed from the step-1 checkpoint
    second.log(3, {"reward": 0.5, "visible_kv": 50.0})
    summary = second.finish()

    text = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert text[2] == torn
    lines = [json.loads(line) for line in text[:2] + text[3:]]
    assert [(row["step"], row["reward"]) for row in lines] == [(1, 0.1), (2, 0.2), (2, 0.25), (3, 0.5)]
    assert lines[2]["elapsed_s"] >= elapsed_before
    assert "3 / 3" in summary
    assert "0.1000 (step 1) -> 0.5000 (step 3)" in summary
    assert "30.0 tokens" in summary  # latest value per step: (10 + 30 + 50) / 3
    assert "traces           0 (no trace log)" in summary
    assert "accuracy         n/a" in summary
    sessions = [wandb_run(path) for path in wandb_files(tmp_path)]  # one offline folder per session
    assert len(sessions) == 2 and sessions[0]["id"] == sessions[1]["id"]  # one W&B run, resumed
    assert [[row["reward"] for row in s["history"]] for s in sessions] == [[0.1, 0.2], [0.25, 0.5]]


def test_monitor_rejects_bad_metrics_and_steps(tmp_path):
    cfg = MonitorConfig(wandb=WandbConfig(mode="disabled"), plots=False)
    with pytest.raises(ValueError, match="total_steps"):
        Monitor(tmp_path, cfg, total_steps=0)
    monitor = Monitor(tmp_path, cfg, total_steps=2)
    with pytest.raises(ValueError, match="'reward' must be a number"):
        monitor.log(1, {"reward": "high"})
    with pytest.raises(ValueError, match="'step'"):
        monitor.log(1, {"step": 3})
    monitor.log(1, {"reward": 1})
    monitor.finish()
    with pytest.raises(RuntimeError, match="after finish"):
        monitor.log(2, {"reward": 1.0})
    assert not list(tmp_path.glob("*.png"))
    assert not (tmp_path / "wandb").exists()


def test_monitor_config_documents_and_checks_every_key():
    for section in (MonitorConfig, WandbConfig):
        for name, field in section.model_fields.items():
            assert field.description, f"{section.__name__}.{name} has no docstring"
    cfg = MonitorConfig()
    assert cfg.wandb.mode == "offline" and cfg.dashboard_host == "127.0.0.1"
    assert cfg.ray_init_kwargs() == {"include_dashboard": True, "dashboard_host": "127.0.0.1",
                                     "dashboard_port": 8265}
    with pytest.raises(ValidationError, match="did you mean 'log_every'"):
        MonitorConfig.model_validate({"log_evry": 2})
    with pytest.raises(ValidationError, match="mode"):
        MonitorConfig.model_validate({"wandb": {"mode": "onlin"}})
    with pytest.raises(ValidationError, match="dashboard_port"):
        MonitorConfig.model_validate({"dashboard_port": 70000})


# ------------------------------------------------------------------------------ the step report

# metrics.jsonl keys that tests, benchmarks and users' dashboards read
JSONL_KEYS = {"reward", "accuracy", "visible_kv", "peak_visible_kv", "completion_tokens", "rollout_tokens_per_s",
              "stale_groups_dropped", "staleness_mean", "staleness_max", "queue_depth", "version",
              "worker_restarts", "duplicate_groups", "reissued_groups", "learner_step_seconds", "preempted_traces",
              "learner_restarts"}


def step_report(**overrides) -> StepReport:
    values = dict(reward=0.5, accuracy=0.25, visible_kv=40.0, peak_visible_kv=55.0, completion_tokens=12.0, rollout_tokens_per_s=300.0,
                  stale_groups_dropped=3, staleness_mean=0.5, staleness_max=1, queue_depth=2, version=7,
                  worker_restarts=0, duplicate_groups=1, reissued_groups=1, learner_step_seconds=1.25)
    return StepReport(**{**values, **overrides})


def test_the_summary_gives_the_share_of_arrived_groups_dropped_as_stale(tmp_path):
    # Catches (issue 37): the summary said "stale dropped 15 groups" beside a recipe comment saying its staleness
    # drops none, with nothing to compare: it now gives the share of the groups that arrived (trained + dropped).
    # Two steps of 8 trained groups with 3 and 1 dropped: 4 of 4 + 16 = 20 arrived, 20%. Rows written before
    # steps counted their groups keep the count alone.
    monitor = Monitor(tmp_path / "new", MonitorConfig(wandb=WandbConfig(mode="disabled"), plots=False), total_steps=2)
    monitor.log(1, step_report(stale_groups_dropped=3, trained_groups=8).as_dict())
    monitor.log(2, step_report(stale_groups_dropped=1, trained_groups=8).as_dict())
    assert "stale dropped    4 of 20 arrived groups (20.0%)" in monitor.finish()
    old = Monitor(tmp_path / "old", MonitorConfig(wandb=WandbConfig(mode="disabled"), plots=False), total_steps=1)
    old.log(1, step_report(stale_groups_dropped=3).as_dict())
    assert "stale dropped    3 groups" in old.finish()


def test_step_report_flattens_to_the_metrics_jsonl_names():
    # catches: a renamed or unprefixed metric (metrics.jsonl keys are read by tests, benchmarks and
    # dashboards), a None written as a value, an evaluation logged without its eval_before/ prefix
    assert set(step_report().as_dict()) == JSONL_KEYS  # no sync, no learner metrics, no eval
    # the learner's StepMetrics: no mismatch measured (None, left out), its version is the report's own
    learner = StepMetrics(loss=0.25, grad_norm=1.5, kl_mismatch=None, kl_mismatch_k1=None, logprob_diff_max=None,
                          num_tokens=100, num_loss_tokens=40, num_traces=8, num_windows=8, num_micro_batches=1,
                          skipped_traces_no_loss=0, step_seconds=1.25, version=7, stepped=True, lr=1e-4,
                          algorithm={"zero_variance_groups": 1.0})
    report = step_report(weight_sync_seconds=0.5, learner=learner, eval_before=EvalResult(4, 0.75, 10.0, 8.5, 9, "full"))
    flat = report.as_dict()
    learner_keys = {f"learner/{k}" for k in ("loss", "grad_norm", "num_tokens", "num_loss_tokens", "num_traces",
                                             "num_windows", "num_micro_batches", "skipped_traces_no_loss",
                                             "step_seconds", "stepped", "lr", "zero_variance_groups")}
    assert set(flat) == JSONL_KEYS | learner_keys | {
        "weight_sync_seconds", "eval_before/num_problems", "eval_before/accuracy", "eval_before/mean_tokens",
        "eval_before/mean_visible_kv", "eval_before/peak_visible_kv"}
    assert (flat["version"], flat["learner/loss"], flat["learner/stepped"], flat["eval_before/accuracy"],
            flat["eval_before/peak_visible_kv"]) == (7, 0.25, 1.0, 0.75, 9.0)


def test_summary_reads_the_step_reports_metrics(tmp_path):
    # catches: a StepReport field and the name the summary/plots look up drifting apart (the
    # summary would say n/a, the plot would be missing)
    monitor = Monitor(tmp_path, MonitorConfig(wandb=WandbConfig(mode="disabled")), total_steps=2)
    monitor.log(1, step_report().as_dict())
    monitor.log(2, step_report(reward=0.75, visible_kv=50.0, stale_groups_dropped=0,
                               learner_step_seconds=0.75, preempted_traces=0.5, learner_restarts=1,
                               worker_restarts=2).as_dict())
    summary = monitor.finish()
    assert "0.5000 (step 1) -> 0.7500 (step 2)" in summary  # reward
    assert "0.2500 (step 1) -> 0.2500 (step 2)" in summary  # accuracy
    assert "45.0 tokens" in summary  # visible KV (40 + 50) / 2
    assert "300.0 (mean" in summary  # rollout tok/s
    assert "1.000 s" in summary  # learner step (1.25 + 0.75) / 2
    assert "stale dropped    3 groups" in summary  # 3 + 0
    assert "preempted        25.0% of the traces" in summary  # (0 + 0.5) / 2
    # catches: restarts missing from the summary (issue 36: a learner rank that died is restarted and counted);
    # both counts are running totals, so the last step's: 1 learner, 2 rollout worker (not the sums 1, 2 + 0)
    assert "restarts         1 learner, 2 rollout worker" in summary
    assert (tmp_path / "reward.png").is_file() and (tmp_path / "visible_kv.png").is_file()
    with pytest.raises(AttributeError, match="no metric 'visible_kv_tokens'"):
        KEYS.visible_kv_tokens


def test_the_summary_says_when_the_first_step_came_after_sliderl_started(tmp_path):
    # catches: the startup time counted from the Monitor's creation (Ray, the warm start, the actors and the eval
    # before all come earlier), or taken at an evaluation's row, or moved by a later step. The independent clock:
    # a fresh process's own time.time() around `import sliderl` and around the first step's log, with a second's
    # sleep between them. Planted: time.monotonic() - self._started for the value, and the first row of any
    # kind (the evaluation logged 0.5 s earlier): both fail.
    import subprocess
    import sys

    script = f"""
import json, time
t0 = time.time()
import sliderl
t1 = time.time()
time.sleep(1.0)
from sliderl.cluster.config.monitor import MonitorConfig, WandbConfig
from sliderl.cluster.observe.monitor import Monitor
m = Monitor({str(tmp_path)!r}, MonitorConfig(wandb=WandbConfig(mode="disabled")), total_steps=2)
m.log(0, {{"eval_before/accuracy": 0.5}})
time.sleep(0.5)
t2 = time.time()
m.log(1, {{"reward": 0.5, "learner_step_seconds": 1.0}})
t3 = time.time()
first = m.first_step_s
m.log(2, {{"reward": 0.5, "learner_step_seconds": 1.0}})
print(json.dumps(dict(first=first, again=m.first_step_s, low=t2 - t1, high=t3 - t0, summary=m.finish())))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["low"] >= 1.5 and seen["low"] <= seen["first"] <= seen["high"] and seen["again"] == seen["first"]
    assert f"first step       {seen['first']:.1f} s after sliderl started" in seen["summary"]


# ----------------------------------------------------------------------------------- Ray metrics


def scrape(port: int) -> dict[tuple, float]:
    """{(sample name, (role, worker_id[, le])): value} for the sliderl samples."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith("ray_sliderl_"):
                bucket = (s.labels["le"],) if "le" in s.labels else ()
                labels = (s.labels.get("role"), s.labels.get("worker_id")) + bucket
                samples[(s.name, labels)] = s.value
    return samples


def test_ray_metrics_recorded_inside_an_actor(monkeypatch):
    ray = pytest.importorskip("ray")
    monkeypatch.setenv("RAY_metrics_report_interval_ms", "200")

    @ray.remote
    class Recorder:
        def record(self) -> bool:
            self.rollout = RolloutMetrics(worker_id=3)
            self.learner = LearnerMetrics()
            self.rollout.record(tokens_per_s=250.0, visible_kv=48.0, reward=0.5)
            self.learner.record(step_seconds=1.5, staleness=1, weight_sync_seconds=0.25, queue_depth=4, reward=0.75)
            self.learner.record(step_seconds=2.5, queue_depth=2)  # no sync this step
            return True

    # a new local instance: a bare ray.init() would attach to a cluster the user left running (`ray start`)
    start_local_ray(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        recorder = Recorder.remote()
        assert ray.get(recorder.record.remote())
        port = ray.nodes()[0]["MetricsExportPort"]
        expected = {
            ("ray_sliderl_rollout_tokens_per_s", ("rollout", "3")): 250.0,
            ("ray_sliderl_visible_kv_tokens", ("rollout", "3")): 48.0,
            ("ray_sliderl_reward", ("rollout", "3")): 0.5,
            ("ray_sliderl_reward", ("learner", "learner")): 0.75,
            ("ray_sliderl_staleness_versions", ("learner", "learner")): 1.0,
            ("ray_sliderl_queue_depth", ("learner", "learner")): 2.0,  # the latest value
            # histograms as cumulative bucket counts (Ray reports a bucket's midpoint as the sum)
            ("ray_sliderl_learner_step_seconds_count", ("learner", "learner")): 2.0,
            ("ray_sliderl_learner_step_seconds_bucket", ("learner", "learner", "1.0")): 0.0,
            ("ray_sliderl_learner_step_seconds_bucket", ("learner", "learner", "2.0")): 1.0,  # 1.5
            ("ray_sliderl_learner_step_seconds_bucket", ("learner", "learner", "5.0")): 2.0,  # 1.5, 2.5
            ("ray_sliderl_weight_sync_seconds_count", ("learner", "learner")): 1.0,
            ("ray_sliderl_weight_sync_seconds_bucket", ("learner", "learner", "0.1")): 0.0,
            ("ray_sliderl_weight_sync_seconds_bucket", ("learner", "learner", "0.25")): 1.0,  # 0.25
            ("ray_sliderl_learner_steps_total", ("learner", "learner")): 2.0,
        }
        deadline = time.monotonic() + 30  # the node exports every 200 ms; poll its endpoint
        while True:
            got = scrape(port)
            if all(key in got for key in expected) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert {key: got.get(key, math.nan) for key in expected} == pytest.approx(expected)
        # the shipped Grafana dashboard queries only series that exist. Catches: a panel left on a renamed
        # metric, or one missing Ray's ray_ prefix or a histogram's _bucket/_sum/_count suffix (an empty panel)
        queried = dashboard_series()
        assert queried and queried <= {name for name, _ in got}, queried - {name for name, _ in got}
    finally:
        ray.shutdown()


def dashboard_series() -> set[str]:
    """Every ``ray_sliderl_*`` series a PromQL expression of docs/grafana/sliderl.json reads."""
    import re

    dashboard = json.loads((Path(__file__).resolve().parents[1] / "docs/grafana/sliderl.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    return {name for expr in exprs for name in re.findall(r"\b(?:ray_)?sliderl_\w+", expr)}


def test_metrics_jsonl_is_strict_json_when_a_value_is_not_finite(tmp_path):
    # Catches: a NaN reward written as the bare token NaN (json.dumps' default), which strict JSON
    # readers reject, and a resumed Monitor choking on the null that replaces it.
    from sliderl.cluster.config.monitor import MonitorConfig, WandbConfig
    from sliderl.cluster.observe.monitor import Monitor

    cfg = MonitorConfig(wandb=WandbConfig(mode="disabled"), plots=True)
    first = Monitor(tmp_path, cfg, total_steps=3)
    first.log(1, {"reward": float("nan"), "visible_kv": 4.0})
    first.log(2, {"reward": 0.5, "visible_kv": float("inf")})
    first.finish()

    def no_constants(name):
        raise ValueError(f"not strict JSON: {name}")

    rows = [json.loads(line, parse_constant=no_constants) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["reward"] is None and rows[1]["visible_kv"] is None and rows[1]["reward"] == 0.5
    second = Monitor(tmp_path, cfg, total_steps=3)  # a resume reads the nulls back
    second.log(3, {"reward": 1.0, "visible_kv": 5.0})
    summary = second.finish()
    assert "0.5000 (step 2) -> 1.0000 (step 3)" in summary


# ------------------------------------------------------------------------------ summary and plots


def test_summary_has_both_evaluations_and_the_mean_reward_of_the_last_steps(tmp_path):
    """summary.txt carries the before/after evaluation lines and the reward averaged over the last steps.
    Catches: the last step's noisy reward reported as the result, or an evaluation left out of the summary."""
    monitor = Monitor(tmp_path, MonitorConfig(wandb=WandbConfig(mode="disabled"), plots=False), total_steps=12)
    before = EvalResult(accuracy=0.5, num_problems=64, mean_tokens=30.0, mean_visible_kv=20.5, peak_visible_kv=28,
                        kv_policy="prefix_sliding:24")
    after = EvalResult(accuracy=0.75, num_problems=64, mean_tokens=28.0, mean_visible_kv=19.0, peak_visible_kv=27,
                       kv_policy="prefix_sliding:24")
    for step in range(1, 13):
        metrics = {KEYS.reward: 0.1 * step if step < 12 else 0.0}  # a bad last step: 0.0
        if step == 1:
            metrics.update(before.as_metrics("eval_before"))
        if step == 12:
            metrics.update(after.as_metrics("eval_after"))
        monitor.log(step, metrics)
    summary = monitor.finish()
    # 12 steps: a window of 5, steps 8-12: (0.8 + 0.9 + 1.0 + 1.1 + 0.0) / 5 = 0.76
    assert "reward, last     0.7600 (mean of steps 8-12)" in summary
    assert "eval before      accuracy 0.500 on 64 problems, visible KV mean 20.5 peak 28, 30.0 tokens" in summary
    assert "eval after       accuracy 0.750 on 64 problems, visible KV mean 19.0 peak 27, 28.0 tokens" in summary


def test_visible_kv_plot_starts_at_zero_with_prompt_window_and_bound_lines():
    """visible_kv.png shows what "bounded" means: the y axis from 0, and the mean prompt, the window and their
    sum (prefix_sliding's bound) as reference lines. Catches: an autoscaled axis that starts near the data (a flat
    bounded curve then looks like noise), or the bound drawn at W alone."""
    from matplotlib.figure import Figure

    from sliderl.cluster.observe.monitor import _visible_kv_axes

    history = {s: {KEYS.visible_kv: 40.0 + s, KEYS.peak_visible_kv: 50.0, KEYS.prompt_tokens: 12.0} for s in (1, 2, 3)}
    ax = Figure().add_subplot()
    _visible_kv_axes(ax, history, [1, 2, 3], [41.0, 42.0, 43.0], "prefix_sliding:24")
    assert ax.get_ylim()[0] == 0
    horizontal = sorted(line.get_ydata()[0] for line in ax.get_lines() if line.get_linestyle() != "-")
    assert horizontal == [12.0, 24.0, 36.0]  # prompt (mean 12), W = 24, prompt + W = 36
    assert ax.get_ylim()[1] >= 50.0  # the peak curve is inside the axes
