"""The driver's ``Monitor``: metrics.jsonl, W&B, a progress bar, plots and the end-of-run summary,
with its settings (``MonitorConfig``, ``WandbConfig``).

``Monitor.log(step, metrics)`` takes a flat dict of numbers (``StepReport.as_dict()``, or an
evaluation's). ``step`` counts optimizer steps done (1 after the first). The progress bar, the
plots and the summary read some of ``StepReport``'s metrics by their field names (``KEYS``), each
optional; any other key is logged as it is. The Ray metrics the actors export are in
``cluster.observe.ray_metrics``.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import sliderl
from sliderl.cluster.config.monitor import MonitorConfig, WandbConfig
from sliderl.cluster.observe.dashboard import run_name
from sliderl.cluster.records import KEYS

RESERVED = ("step", "elapsed_s")  # written by the Monitor on every JSONL line

METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.txt"
WANDB_ID_FILE = "wandb_run_id"
WANDB_DIR = "wandb"  # W&B's own folder under run_dir (offline runs)
EVAL_DIR = "eval"  # eval/{before,after}.jsonl under run_dir: the completions the evaluations scored
PLOTS = {KEYS.reward: ("reward.png", "reward"), KEYS.visible_kv: ("visible_kv.png", "visible KV tokens")}
# the files a Monitor writes in run_dir, metrics first (a resumed Monitor reads the first two back)
DRIVER_FILES = (METRICS_FILE, WANDB_ID_FILE, SUMMARY_FILE, *(name for name, _ in PLOTS.values()))


# ------------------------------------------------------------------------------------- monitor


class Monitor:
    """The driver's view of a run: every ``log`` appends to ``run_dir/metrics.jsonl`` (flushed),
    goes to W&B and moves a console progress bar with ETA; ``finish`` writes plots and a summary.

    Created again on the same ``run_dir`` (a resumed run) it keeps the earlier lines, reuses the
    W&B run id and counts wall time on from where the last session stopped. ``storage_root``: the
    run's storage root when it is not ``run_dir`` (a URI; run_dir then holds only these files): the
    summary names it and counts the traces there. Several ``log`` calls
    for one step (training metrics, then an evaluation; or a step replayed after a resume) merge
    into one row of the history, later values winning; metrics.jsonl keeps every call as a line.
    """

    def __init__(self, run_dir: str | os.PathLike, cfg: MonitorConfig, total_steps: int,
                 config_dict: dict | None = None, kv_policy: str | None = None, storage_root: str | None = None):
        if total_steps < 1:
            raise ValueError(f"total_steps must be >= 1, got {total_steps}")
        self.run_dir = Path(run_dir)
        self.storage_root = storage_root
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.cfg = cfg
        self.total_steps = total_steps
        self.kv_policy = kv_policy  # the rollouts' policy: visible_kv.png's reference lines
        self.metrics_path = self.run_dir / METRICS_FILE
        self.history, self._elapsed_before = _read_history(self.metrics_path)
        # disabled: no W&B at all (not even the import), e.g. on machines without wandb installed
        self._run = None if cfg.wandb.mode == "disabled" else _start_wandb(self.run_dir, cfg.wandb, config_dict,
                                                                             run_name(storage_root or str(self.run_dir)))
        self._started = time.monotonic()
        self.first_step_s: float | None = None  # this session's first training step, seconds after sliderl started
        self._file = _open_for_append(self.metrics_path)
        self._bar = _progress_bar(total_steps, max(self.history, default=0))
        self._summary: str | None = None

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Record ``metrics`` (flat ``{name: number}``) for optimizer step ``step``."""
        if self._summary is not None:
            raise RuntimeError("Monitor.log called after finish()")
        values = _numbers(metrics)
        if self.first_step_s is None and KEYS.learner_step_seconds in values:
            self.first_step_s = time.time() - sliderl.STARTED
        row = {"step": int(step), "elapsed_s": round(self.elapsed(), 3), **values}
        self.history.setdefault(row["step"], {}).update(row)
        self._file.write(json.dumps(_strict(row), allow_nan=False) + "\n")  # NaN/inf are not JSON: null
        self._file.flush()
        if self._run is not None and (row["step"] % self.cfg.log_every == 0 or row["step"] >= self.total_steps):
            self._run.log(values, step=row["step"])
        self._advance(self.history[row["step"]])

    def elapsed(self) -> float:
        """Wall seconds of this run: earlier sessions plus this one."""
        return self._elapsed_before + time.monotonic() - self._started

    def finish(self, exit_code: int = 0) -> str:
        """Close W&B and the progress bar, write the plots and ``summary.txt``; return the summary.

        Safe to call twice (the second call returns the same summary)."""
        if self._summary is not None:
            return self._summary
        wall_s = self.elapsed()
        self._bar.close()
        self._file.close()
        if self._run is not None:
            self._run.finish(exit_code=exit_code)
        plots = write_plots(self.history, self.run_dir, self.kv_policy) if self.cfg.plots else []
        self._summary = format_summary(self.run_dir, self.history, self.total_steps, wall_s, plots,
                                       self._wandb_note(), self.storage_root, self.first_step_s)
        (self.run_dir / SUMMARY_FILE).write_text(self._summary)
        return self._summary

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.finish(exit_code=0 if exc_type is None else 1)

    def _advance(self, row: dict) -> None:
        delta = min(row["step"], self.total_steps) - self._bar.n
        if delta > 0:
            self._bar.update(delta)
        self._bar.set_postfix_str(_postfix(row), refresh=True)

    def _wandb_note(self) -> str | None:
        mode = self.cfg.wandb.mode
        if mode == "disabled":
            return None
        folder = Path(self._run.dir).parent  # run.dir is <run folder>/files
        return f"{folder} (upload with `wandb sync {folder}`)" if mode == "offline" else f"{mode}: {self._run.url}"


def _numbers(metrics: dict[str, Any]) -> dict[str, int | float]:
    """Validated copy of ``metrics``: string keys, plain int/float values (numpy/torch scalars ok)."""
    out: dict[str, int | float] = {}
    for key, value in metrics.items():
        if not isinstance(key, str) or key in RESERVED:
            raise ValueError(f"metric name {key!r} is not allowed; use a string other than {RESERVED}")
        if isinstance(value, numbers.Integral):
            out[key] = int(value)
            continue
        try:
            out[key] = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"metric {key!r} must be a number, got {value!r}") from None
    return out


def _read_history(path: Path) -> tuple[dict[int, dict], float]:
    """Rows of an existing metrics.jsonl merged by step (later values win) and the last elapsed_s."""
    history: dict[int, dict] = {}
    elapsed = 0.0
    if not path.is_file():
        return history, elapsed
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # a line cut short by a crash: the only one that can be
            print(f"sliderl: skipping unreadable line {number} of {path}", file=sys.stderr)
            continue
        history.setdefault(int(row["step"]), {}).update(row)
        elapsed = float(row.get("elapsed_s", elapsed))
    return history, elapsed


def _open_for_append(path: Path):
    """``path`` opened to append lines; a last line cut short by a crash is ended first."""
    file = open(path, "a+", encoding="utf-8")
    if file.tell() > 0:
        file.seek(file.tell() - 1)
        if file.read(1) != "\n":
            file.write("\n")
    return file


def _start_wandb(run_dir: Path, cfg: WandbConfig, config_dict: dict | None, name: str):
    """A W&B run writing under ``run_dir/wandb``; the id is kept in ``run_dir`` for resumes."""
    import wandb

    id_file = run_dir / WANDB_ID_FILE
    if not id_file.is_file():
        id_file.write_text(uuid.uuid4().hex[:12])
    try:
        return wandb.init(
            project=cfg.project, entity=cfg.entity, name=cfg.name or name,
            tags=cfg.tags, mode=cfg.mode, dir=str(run_dir), config=config_dict,
            id=id_file.read_text().strip(), resume="allow", reinit="finish_previous",
            settings=wandb.Settings(console="off"),
        )
    except wandb.errors.Error as err:
        raise RuntimeError(f"W&B could not start in mode {cfg.mode!r}: {err}; log in "
                           "(`wandb login`) or set monitor.wandb.mode=offline or disabled") from err


def _progress_bar(total_steps: int, done: int):
    from tqdm import tqdm

    return tqdm(total=total_steps, initial=min(done, total_steps), desc="train", unit="step",
                dynamic_ncols=True, file=sys.stderr)


def _postfix(row: dict) -> str:
    shown = [(KEYS.reward, "reward", "{:.3f}"), (KEYS.visible_kv, "kv", "{:.0f}"),
             (KEYS.rollout_tokens_per_s, "tok/s", "{:.0f}")]
    return " ".join(f"{label}={fmt.format(row[key])}" for key, label, fmt in shown
                    if isinstance(row.get(key), (int, float)) and math.isfinite(row[key]))


# ------------------------------------------------------------------------------ plots, summary


def write_plots(history: dict[int, dict], run_dir: Path, kv_policy: str | None = None) -> list[Path]:
    """reward.png and visible_kv.png (those with data); returns the paths.

    reward.png: each step's mean reward, faint, under its moving average (``smoothing_window`` steps),
    with the evaluations' accuracy marked (before training at step 0, after at the last step).
    visible_kv.png: mean and peak visible KV per step from 0 up, with what bounds them as reference
    lines: the mean prompt, the window, and their sum (the most a prefix_sliding step can see).
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    written = []
    for key, (filename, label) in PLOTS.items():
        steps, values = _series(history, key)
        if not steps:
            continue
        fig = Figure(figsize=(6.4, 3.8), dpi=100)
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        if key == KEYS.reward:
            _reward_axes(ax, history, steps, values)
        else:
            _visible_kv_axes(ax, history, steps, values, kv_policy)
        policy = f" ({kv_policy})" if kv_policy and key == KEYS.visible_kv else ""
        ax.set(xlabel="step", ylabel=label, title=f"{label} against step{policy}")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best")
        fig.tight_layout()
        fig.savefig(run_dir / filename)
        written.append(run_dir / filename)
    return written


def smoothing_window(n: int) -> int:
    """Steps averaged by the reward curve and the summary's "last steps": a tenth of the run, 5 to 20."""
    return max(1, min(n, max(5, min(20, n // 10))))


def moving_average(values: list[float], window: int) -> list[float]:
    """Trailing mean over the last ``window`` values (fewer at the start)."""
    sums, out = [0.0], []
    for v in values:
        sums.append(sums[-1] + v)
    for i in range(1, len(values) + 1):
        lo = max(0, i - window)
        out.append((sums[i] - sums[lo]) / (i - lo))
    return out


def _reward_axes(ax, history: dict[int, dict], steps: list[int], values: list[float]) -> None:
    window = smoothing_window(len(values))
    ax.plot(steps, values, color="tab:blue", alpha=0.3, linewidth=1, label="reward per step")
    ax.plot(steps, moving_average(values, window), color="tab:blue", linewidth=2,
            label=f"mean of the last {window} steps")
    for name, marker, color in (("eval_before", "o", "tab:green"), ("eval_after", "s", "tab:red")):
        at = [(0 if name == "eval_before" else s, row[f"{name}/accuracy"]) for s, row in sorted(history.items())
              if isinstance(row.get(f"{name}/accuracy"), (int, float))]
        if at:
            x, y = zip(*at)
            ax.scatter(x, y, marker=marker, color=color, zorder=3, s=40,
                       label=f"{name.replace('_', ' ')} accuracy {y[-1]:.3f}")


def _visible_kv_axes(ax, history: dict[int, dict], steps: list[int], values: list[float],
                     kv_policy: str | None) -> None:
    from sliderl.core.kv_policy import KVPolicy

    ax.plot(steps, values, color="tab:blue", label="mean per decode step")
    peak_steps, peaks = _series(history, KEYS.peak_visible_kv)
    if peak_steps:
        ax.plot(peak_steps, peaks, color="tab:orange", alpha=0.8, label="peak")
    _, prompts = _series(history, KEYS.prompt_tokens)
    prompt = sum(prompts) / len(prompts) if prompts else None
    policy = KVPolicy.parse(kv_policy) if kv_policy else None
    lines = []
    if prompt is not None:
        lines.append((prompt, "prompt (mean)", ":"))
    if policy is not None and policy.bounded:
        lines.append((policy.window, f"window W = {policy.window}", "--"))
        kept = {"prefix_sliding": prompt, "streaming": policy.sinks, "sliding_window": 0}[policy.kind]
        if kept:
            lines.append((kept + policy.window, f"{'prompt (mean)' if policy.kind == 'prefix_sliding' else 'sinks'} + W: "
                          "the most a step sees", "-."))
    for y, label, style in lines:
        ax.axhline(y, color="gray", linestyle=style, linewidth=1, label=label)
    top = max([*values, *peaks, *(y for y, _, _ in lines)])
    ax.set_ylim(0, top * 1.1 if top > 0 else 1)


def _strict(row: dict) -> dict:
    """``row`` with non-finite numbers as None, so that it is strict JSON."""
    return {k: v if not isinstance(v, float) or math.isfinite(v) else None for k, v in row.items()}


def _series(history: dict[int, dict], key: str) -> tuple[list[int], list[float]]:
    steps = [s for s in sorted(history) if isinstance(history[s].get(key), (int, float))
             and math.isfinite(history[s][key])]
    return steps, [history[s][key] for s in steps]


def format_summary(run_dir: Path, history: dict[int, dict], total_steps: int, wall_s: float,
                   plots: list[Path], wandb_note: str | None, storage_root: str | None = None,
                   first_step_s: float | None = None) -> str:
    """The one-screen end-of-run report; ``storage_root``: where the run's traces and checkpoints are, when
    not in ``run_dir``; ``first_step_s``: when this session's first training step was logged, seconds after the
    driver first imported sliderl (``sliderl.STARTED``: for ``sliderl train``, the command's start but for the
    interpreter's own ~0.1 s), so what it counts is startup: Ray, the warm start, the actors, the eval before."""
    last = max(history, default=0)
    lines = [
        f"sliderl run {storage_root or run_dir}",
        f"  steps            {last} / {total_steps}",
        f"  wall time        {_duration(wall_s)}",
        *([f"  first step       {first_step_s:.1f} s after sliderl started (this session's)"]
          if first_step_s is not None else []),
        f"  reward           {_first_last_text(history, KEYS.reward)}",
        f"  reward, last     {_last_mean_text(history, KEYS.reward)}",
        f"  accuracy         {_first_last_text(history, KEYS.accuracy)}",
        f"  visible KV       {_mean_text(history, KEYS.visible_kv, '{:.1f} tokens (mean over steps)')}",
        f"  rollout tok/s    {_mean_text(history, KEYS.rollout_tokens_per_s, '{:.1f} (mean over steps)')}",
        f"  learner step     {_mean_text(history, KEYS.learner_step_seconds, '{:.3f} s (mean)')}",
        f"  stale dropped    {_stale_text(history)}",
        f"  restarts         {_restarts_text(history)}",
        f"  preempted        {_mean_text(history, KEYS.preempted_traces, '{:.1%} of the traces (mean over steps)')}",
        f"  traces           {_trace_count(storage_root or run_dir)}",
        f"  metrics          {f'{storage_root}/{METRICS_FILE}' if storage_root else run_dir / METRICS_FILE}",
    ]
    evals = [f"  {name.replace('_', ' '):<17}{_eval_text(history, name)}" for name in ("eval_before", "eval_after")
             if _eval_text(history, name)]
    at = next(i for i, line in enumerate(lines) if line.startswith("  accuracy")) + 1
    lines[at:at] = evals
    if plots:
        lines.append(f"  plots            {', '.join(str(p) for p in plots)}")
    if wandb_note:
        lines.append(f"  W&B              {wandb_note}")
    return "\n".join(lines) + "\n"


def _restarts_text(history: dict[int, dict]) -> str:
    """The run's restarts so far (both counts are running totals): rollout workers and the learner."""
    if not history:
        return "n/a"
    row = history[max(history)]
    return f"{row.get(KEYS.learner_restarts, 0):g} learner, {row.get(KEYS.worker_restarts, 0):g} rollout worker"


def _first_last_text(history: dict[int, dict], key: str) -> str:
    steps, values = _series(history, key)
    if not steps:
        return "n/a"
    return f"{values[0]:.4f} (step {steps[0]}) -> {values[-1]:.4f} (step {steps[-1]})"


def _last_mean_text(history: dict[int, dict], key: str) -> str:
    """Mean of the last ``smoothing_window`` steps: one step's mean reward over a few groups is noisy."""
    steps, values = _series(history, key)
    if not steps:
        return "n/a"
    n = smoothing_window(len(values))
    return f"{sum(values[-n:]) / n:.4f} (mean of steps {steps[-n]}-{steps[-1]})"


def _eval_text(history: dict[int, dict], name: str) -> str | None:
    """The evaluation ``name`` (eval_before / eval_after) as one line, or None when the run has none."""
    rows = [row for _, row in sorted(history.items()) if isinstance(row.get(f"{name}/accuracy"), (int, float))]
    if not rows:
        return None
    row = rows[-1]
    get = lambda k: row.get(f"{name}/{k}", math.nan)  # noqa: E731
    return (f"accuracy {get('accuracy'):.3f} on {get('num_problems'):.0f} problems, visible KV mean "
            f"{get('mean_visible_kv'):.1f} peak {get('peak_visible_kv'):.0f}, {get('mean_tokens'):.1f} tokens")


def _mean_text(history: dict[int, dict], key: str, fmt: str) -> str:
    _, values = _series(history, key)
    return fmt.format(sum(values) / len(values)) if values else "n/a"


def _stale_text(history: dict[int, dict]) -> str:
    """Groups dropped as stale, with their share of the groups that arrived (trained + dropped) when the
    steps counted their trained groups."""
    _, stale = _series(history, KEYS.stale_groups_dropped)
    if not stale:
        return "n/a"
    _, trained = _series(history, KEYS.trained_groups)
    if len(trained) < len(stale):  # rows written before steps counted them
        return f"{sum(stale):g} groups"
    arrived = sum(stale) + sum(trained)
    return f"{sum(stale):g} of {arrived:g} arrived groups ({sum(stale) / arrived:.1%})" if arrived else "0 groups"


def _trace_count(root: str | os.PathLike) -> str:
    from sliderl.cluster.storage.root import Storage
    from sliderl.cluster.storage.trace_log import TraceLog

    storage = Storage(root)
    if not storage.is_dir(storage.path("traces")):
        return "0 (no trace log)"
    return f"{TraceLog(storage).count()} in {storage.uri(storage.path('traces'))}"


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h {minutes:02d}m {secs:02d}s" if hours else f"{minutes}m {secs:02d}s"
