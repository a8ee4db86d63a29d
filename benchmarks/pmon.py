"""Per-process GPU utilisation: ``nvidia-smi pmon`` read while a benchmark runs, its samples summed per group.

``nvidia-smi pmon -s u -d 1`` prints, once a second, one line per process on a GPU with its SM utilisation over
that second ("-" when it ran no kernel). ``ProcessSampler`` keeps every line as ``(unix time, pid, sm %)``, the
time being when the line was read (pmon runs line-buffered under ``stdbuf`` where it exists; without it a pipe
may hold lines back for seconds). ``busy_seconds`` sums them per group of processes (the arms of ``long_rl.py``,
the roles of ``colocate.py``): a process at 60% for 10 samples kept the GPU busy 6 s. Two processes on one GPU
each get their own share, which is how one GPU still tells the rollout engine's busy time from the learner's.
Where nvidia-smi is missing, nothing is sampled (an empty list).
"""
from __future__ import annotations

import shutil
import subprocess
import threading
import time
from typing import Callable

PMON = ["nvidia-smi", "pmon", "-s", "u", "-d", "1"]  # the command long_rl.py's busy seconds came from on the H200


class PmonLines:
    """pmon's lines one at a time: ``feed(line, stamp)`` returns ``(stamp, pid, sm %)`` for a sample line, else
    None. Columns are found by the header's names (``# gpu pid type sm mem ...``: drivers differ in which
    follow); idle samples ("-"), the units line and anything else give None."""

    def __init__(self):
        self.names: list[str] = []

    def feed(self, line: str, stamp: float) -> tuple[float, int, float] | None:
        fields = line.split()
        if fields and fields[0].startswith("#"):
            words = [w.lower() for w in " ".join(fields).lstrip("#").split()]
            if "pid" in words:
                self.names = words
            return None
        row = dict(zip(self.names, fields))  # the trailing command may be missing or hold spaces: not read
        if not row.get("pid", "").isdigit() or not row.get("sm", "").isdigit():
            return None
        return stamp, int(row["pid"]), float(row["sm"])


def parse_pmon(lines: list[str], arrival: list[float]) -> list[tuple[float, int, float]]:
    """``PmonLines`` over ``lines``, line i read at ``arrival[i]``: every sample."""
    reader = PmonLines()
    got = (reader.feed(line, stamp) for line, stamp in zip(lines, arrival, strict=True))
    return [sample for sample in got if sample is not None]


def busy_seconds(samples, group_of: Callable[[int], str | None], since: float | None = None,
                 until: float | None = None) -> dict[str, float]:
    """Seconds each group kept a GPU busy: the sum of its processes' sm % / 100 over the samples (one per second)
    stamped in [since, until]; a pid ``group_of`` maps to None is not counted."""
    busy: dict[str, float] = {}
    for stamp, pid, sm in samples:
        if (since is not None and stamp < since) or (until is not None and stamp > until):
            continue
        group = group_of(pid)
        if group is not None:
            busy[group] = busy.get(group, 0.0) + sm / 100
    return busy


class ProcessSampler:
    """``nvidia-smi pmon`` in the background from construction to ``stop()``, which returns its samples.
    ``label(pid)``, when given, is called once per process on its first sample, while it still runs (e.g. to
    read its environment); ``labels`` keeps the answers."""

    def __init__(self, label: Callable[[int], str | None] | None = None):
        self.samples: list[tuple[float, int, float]] = []
        self.label, self.labels = label, {}
        try:
            line_buffered = ["stdbuf", "-oL"] if shutil.which("stdbuf") else []
            self.proc = subprocess.Popen(line_buffered + PMON, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                         text=True)
        except OSError:
            self.proc = None
            return
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        reader = PmonLines()
        for line in self.proc.stdout:
            sample = reader.feed(line, time.time())
            if sample is None:
                continue
            self.samples.append(sample)
            if self.label is not None and sample[1] not in self.labels:
                self.labels[sample[1]] = self.label(sample[1])

    def stop(self) -> list[tuple[float, int, float]]:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait()
            self.thread.join(timeout=5)
        return list(self.samples)
