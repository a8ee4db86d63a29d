"""Checkpoints: ``run_dir/checkpoints/step_NNNNNN/`` = the learner's checkpoint + the driver's state.

The learner writes its part (Hugging Face layout loadable by transformers and the engine, plus
optimizer, version and RNG) with ``Learner.save_checkpoint``; the driver then writes
``driver_state.json`` and, last, the empty marker ``COMPLETE``. Only a folder with the marker is a
checkpoint: a crash mid-save leaves a folder that ``latest`` ignores and the next save replaces.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

MARKER = "COMPLETE"
STATE_FILE = "driver_state.json"
_STEP_RE = re.compile(r"step_(\d{6,})")


@dataclass
class DriverState:
    """Everything the driver needs to continue a run, besides the learner's own checkpoint."""

    step: int = 0  # optimizer steps done
    version: int = 0  # learner policy version after ``step`` steps
    published_version: int = 0  # newest version the workers were given
    cursor: int = 0  # groups dealt from the prompt stream
    outstanding: list[int] = field(default_factory=list)  # stream indices dealt but not resolved
    trained_group_ids: list[str] = field(default_factory=list)
    stale_group_ids: list[str] = field(default_factory=list)
    duplicate_group_ids: list[str] = field(default_factory=list)
    reissued_group_ids: list[str] = field(default_factory=list)
    worker_restarts: int = 0
    learner_restarts: int = 0

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1) + "\n"

    @classmethod
    def from_json(cls, text: str) -> DriverState:
        data = json.loads(text)
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


class Checkpoints:
    """The checkpoint folders of one run."""

    def __init__(self, run_dir: str | os.PathLike, keep: int = 2):
        self.dir = Path(run_dir) / "checkpoints"
        self.keep = keep

    def path(self, step: int) -> Path:
        return self.dir / f"step_{step:06d}"

    def save(self, step: int, state: DriverState, save_learner: Callable[[str], None]) -> Path:
        """Write checkpoint ``step``: learner part via ``save_learner(path)``, state, marker last."""
        path = self.path(step)
        if path.exists():
            shutil.rmtree(path)  # an incomplete earlier attempt (a complete one is never re-saved)
        path.mkdir(parents=True)
        save_learner(str(path))
        _write_synced(path / STATE_FILE, state.to_json())
        _write_synced(path / MARKER, "")
        self.prune()
        return path

    def complete(self) -> list[Path]:
        """Complete checkpoint folders, oldest first."""
        if not self.dir.is_dir():
            return []
        found = [p for p in self.dir.iterdir() if _STEP_RE.fullmatch(p.name) and (p / MARKER).is_file()]
        return sorted(found, key=lambda p: int(_STEP_RE.fullmatch(p.name).group(1)))

    def latest(self) -> tuple[Path, DriverState] | None:
        """The newest complete checkpoint and its driver state, or None."""
        done = self.complete()
        if not done:
            return None
        return done[-1], DriverState.from_json((done[-1] / STATE_FILE).read_text())

    def prune(self) -> None:
        """Delete all but the newest ``keep`` complete checkpoints."""
        for old in self.complete()[:-self.keep]:
            shutil.rmtree(old, ignore_errors=True)


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
