"""A run's checkpoints: ``run_dir/checkpoints/step_NNNNNN/`` = the learner's checkpoint + ``DriverState``.

The learner writes its part (Hugging Face layout loadable by transformers and the engine, plus
optimizer, version and RNG) with ``Learner.save_checkpoint``, which returns its files' manifest; the
driver then writes ``driver_state.json``, ``manifest.json`` (every file's size and sha256) and, last,
the empty marker ``COMPLETE``. Only a folder with the marker is a checkpoint: a crash mid-save leaves
a folder that ``latest`` ignores and the next save replaces. ``latest`` checks a checkpoint against
its manifest before trusting it, and falls back past damaged ones (``Checkpoints.latest``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from cluster.ledger import LedgerState
from trainer.checkpoint import HF_CONFIG, MODEL_FILE, TRAINER_STATE
from trainer.manifest import MANIFEST, Manifest, write_file

MARKER = "COMPLETE"
STATE_FILE = "driver_state.json"  # in every checkpoint, and the final state beside them
SET_ASIDE = ".damaged"  # suffix of a damaged checkpoint's folder once latest() has passed over it
_STEP_RE = re.compile(r"step_(\d{6,})")
_LEGACY_FILES = (HF_CONFIG, MODEL_FILE, TRAINER_STATE, STATE_FILE)  # every checkpoint has them
# driver_state.json before the ledger kept its own state: flat keys -> LedgerState fields
_OLD_LEDGER_KEYS = {"trained_group_ids": "trained", "stale_group_ids": "stale",
                    "duplicate_group_ids": "duplicates", "reissued_group_ids": "reissued"}


class DamagedCheckpoint(ValueError):
    """A checkpoint folder fails its checks; the message names the file and what is wrong."""


@dataclass
class DriverState:
    """Everything the driver needs to continue a run, besides the learner's own checkpoint."""

    step: int = 0  # optimizer steps done
    version: int = 0  # learner policy version after ``step`` steps
    published_version: int = 0  # newest version the workers were given
    cursor: int = 0  # groups dealt from the prompt stream
    outstanding: list[int] = field(default_factory=list)  # stream indices dealt (or due again) but not resolved
    ledger: LedgerState = field(default_factory=LedgerState)  # how each resolved group ended
    worker_restarts: int = 0
    learner_restarts: int = 0

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1) + "\n"

    @classmethod
    def from_json(cls, text: str) -> DriverState:
        """Reads what ``to_json`` writes, and the flat ``*_group_ids`` keys written before ``ledger``;
        anything else (invalid JSON, a missing, unknown or ill-typed key) raises ValueError saying what."""
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError(f"expected a JSON object, got {type(data).__name__}")
        _check_keys(data, {f.name for f in fields(cls)} - {"ledger"})
        ledger = data.get("ledger") or {new: data[old] for old, new in _OLD_LEDGER_KEYS.items() if old in data}
        if not isinstance(ledger, dict) or set(ledger) - {f.name for f in fields(LedgerState)}:
            raise ValueError(f"ledger must be an object with keys {[f.name for f in fields(LedgerState)]}, "
                             f"got {ledger!r:.200}")
        return cls(**{k: v for k, v in data.items() if k not in _OLD_LEDGER_KEYS and k != "ledger"},
                   ledger=LedgerState(**ledger))

    @classmethod
    def read(cls, path: Path) -> DriverState:
        """``from_json`` of the file ``path``; an unreadable or invalid file raises DamagedCheckpoint
        naming it and the problem."""
        try:
            return cls.from_json(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as err:  # json's decode errors are ValueErrors
            raise DamagedCheckpoint(f"{path} is not a valid driver state: {err}") from None


def _check_keys(data: dict, required: set[str]) -> None:
    """``data`` holds every ``required`` key (ints; ``outstanding`` a list of ints) and nothing unknown."""
    missing = sorted(required - set(data))
    unknown = sorted(set(data) - required - {"ledger"} - set(_OLD_LEDGER_KEYS))
    if missing or unknown:
        wrong = ", ".join(f"{what} keys {keys}" for what, keys in (("missing", missing), ("unknown", unknown)) if keys)
        raise ValueError(f"{wrong} (expected {sorted(required | {'ledger'})})")
    for key in required:
        value = data[key]
        ok = (isinstance(value, list) and all(type(v) is int for v in value)) if key == "outstanding" \
            else type(value) is int
        if not ok:
            raise ValueError(f"{key} must be {'a list of integers' if key == 'outstanding' else 'an integer'}, "
                             f"got {value!r:.100}")


class Checkpoints:
    """The checkpoint folders of one run."""

    def __init__(self, run_dir: str | os.PathLike, keep: int = 2):
        self.dir = Path(run_dir) / "checkpoints"
        self.keep = keep

    def path(self, step: int) -> Path:
        return self.dir / f"step_{step:06d}"

    def save(self, step: int, state: DriverState, save_learner: Callable[[str], Manifest]) -> Path:
        """Write checkpoint ``step``: the learner part via ``save_learner(path)``, which returns its
        files' manifest; the state; ``manifest.json`` with every file (fsync'd); the marker last."""
        path = self.path(step)
        if path.exists():
            shutil.rmtree(path)  # an incomplete earlier attempt (a complete one is never re-saved)
        path.mkdir(parents=True)
        manifest = save_learner(str(path))
        manifest.add(STATE_FILE, write_file(path / STATE_FILE, state.to_json().encode()))
        manifest.write(path)
        write_file(path / MARKER, b"")
        self.prune()
        return path

    def complete(self) -> list[Path]:
        """Complete checkpoint folders, oldest first."""
        if not self.dir.is_dir():
            return []
        found = [p for p in self.dir.iterdir() if _STEP_RE.fullmatch(p.name) and (p / MARKER).is_file()]
        return sorted(found, key=lambda p: int(_STEP_RE.fullmatch(p.name).group(1)))

    def latest(self) -> tuple[Path, DriverState] | None:
        """The newest complete checkpoint that passes ``load``, and its driver state; None when none does.

        Each newer one that fails is set aside (renamed ``step_NNNNNN.damaged``, so that neither a
        resume nor ``prune`` counts it; delete it once looked at) with a warning naming it and why. A
        checkpoint without a manifest that fails raises DamagedCheckpoint instead: without a manifest
        the check is too weak to pass over a folder silently, so the message says which one to remove.
        """
        for path in reversed(self.complete()):
            try:
                return path, self.load(path)
            except DamagedCheckpoint as err:
                if not (path / MANIFEST).exists():
                    raise DamagedCheckpoint(f"checkpoint {path} (written before checkpoints had a manifest) is damaged: "
                                            f"{err}; remove that folder to resume from the one before it") from None
                _set_aside(path, str(err))
        return None

    @staticmethod
    def load(path: Path) -> DriverState:
        """The driver state of checkpoint folder ``path`` once its files pass the checks; otherwise
        DamagedCheckpoint naming the file and what is wrong.

        With a ``manifest.json``, every file it lists must have its size (all compared first, a stat
        each) and its sha256: that reads the whole checkpoint once more, a cost paid at a resume or a
        learner restart, never at a save. A checkpoint without one was written before manifests: it is
        accepted when the files every checkpoint has are there (no sizes to compare them with) and its
        driver state reads.
        """
        try:
            manifest = Manifest.read(path)
        except ValueError as err:
            raise DamagedCheckpoint(str(err)) from None
        problem = manifest.damage(path) if manifest is not None else _missing(path, _LEGACY_FILES)
        if problem is not None:
            raise DamagedCheckpoint(problem)
        return DriverState.read(path / STATE_FILE)

    def prune(self) -> None:
        """Delete all but the newest ``keep`` complete checkpoints.

        Damaged ones that ``latest`` found are set aside and not counted. Damage nobody has looked for
        (finding it takes a full read) is counted: a checkpoint that rots on disk after its save still
        takes one of the ``keep`` places until a resume or a restart finds it.
        """
        for old in self.complete()[:-self.keep]:
            shutil.rmtree(old, ignore_errors=True)


def _missing(path: Path, names: tuple[str, ...]) -> str | None:
    gone = [name for name in names if not (path / name).is_file()]
    return f"{path} lacks {', '.join(gone)}" if gone else None


def _set_aside(path: Path, why: str) -> None:
    """Rename a damaged checkpoint out of ``complete()``'s sight (replacing an earlier set-aside copy of
    the same step), with a warning naming it and why."""
    aside = path.with_name(path.name + SET_ASIDE)
    try:
        if aside.exists():
            shutil.rmtree(aside)
        path.rename(aside)
        where = f"set aside as {aside.name}"
    except OSError as err:
        where = f"could not be set aside ({err.strerror or err})"
    print(f"sliderl: warning: checkpoint {path.name} is damaged and skipped: {why}; {where}; trying the "
          "one before it", file=sys.stderr, flush=True)
