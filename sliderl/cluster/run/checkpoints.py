"""A run's checkpoints: ``run_dir/checkpoints/step_NNNNNN/`` = the learner's checkpoint + ``DriverState``.

``run_dir`` is a storage root (``cluster.storage.root``): a local folder, or a URI such as
``s3://bucket/run`` that every node reaches. The learner writes its part (Hugging Face layout loadable
by transformers and the engine, plus optimizer, version and RNG) with ``Learner.save_checkpoint`` —
into the folder itself when it is local, else uploaded by the learner actor from whatever node it runs
on — and returns its files' manifest; only then does the driver write ``driver_state.json``,
``manifest.json`` (every file's size and sha256) and, last, the empty marker ``COMPLETE``. Only a
folder with the marker is a checkpoint: a crash mid-save leaves a folder that ``latest`` ignores and
the next save replaces. ``latest`` checks a checkpoint against its manifest before trusting it, and
falls back past damaged ones (``Checkpoints.latest``).
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path, PurePath

from sliderl.cluster.run.ledger import LedgerState
from sliderl.cluster.storage.root import Storage
from sliderl.trainer.checkpoint import HF_CONFIG, MODEL_FILE, TRAINER_STATE
from sliderl.trainer.manifest import MANIFEST, Manifest

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
    def read(cls, path: PurePath, storage: Storage | None = None) -> DriverState:
        """``from_json`` of the file ``path`` (local, or in ``storage``); an unreadable or invalid file raises
        DamagedCheckpoint naming it and the problem."""
        try:
            data = storage.read_bytes(path) if storage is not None else Path(path).read_bytes()
            return cls.from_json(data.decode("utf-8"))
        except (OSError, ValueError) as err:  # json's and utf-8's decode errors are ValueErrors
            where = storage.uri(path) if storage is not None else path
            raise DamagedCheckpoint(f"{where} is not a valid driver state: {err}") from None


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
    """The checkpoint folders of one run, under its storage root (a local folder or a URI)."""

    def __init__(self, run_dir: str | os.PathLike | Storage, keep: int = 2):
        self.storage = run_dir if isinstance(run_dir, Storage) else Storage(run_dir)
        self.dir = self.storage.path("checkpoints")
        self.keep = keep

    def path(self, step: int) -> PurePath:
        return self.dir / f"step_{step:06d}"

    def is_complete(self, step: int) -> bool:
        return self.storage.is_file(self.path(step) / MARKER)

    def save(self, step: int, state: DriverState, save_learner: Callable[[str], Manifest]) -> PurePath:
        """Write checkpoint ``step``: the learner part via ``save_learner(location)`` (the folder's local path
        or URI), which returns its files' manifest once they are all written; then the state,
        ``manifest.json`` with every file, and the marker last (each file whole or absent)."""
        path = self.path(step)
        self.storage.delete(path)  # an incomplete earlier attempt (a complete one is never re-saved)
        self.storage.make_dir(path)
        manifest = save_learner(self.storage.uri(path))
        manifest.add(STATE_FILE, self.storage.write_bytes(path / STATE_FILE, state.to_json().encode()))
        self.storage.write_bytes(path / MANIFEST, manifest.to_json().encode())
        self.storage.write_bytes(path / MARKER, b"")
        self.prune()
        return path

    def write_state(self, state: DriverState) -> None:
        """The driver state beside the checkpoints (``run_dir/driver_state.json``): where the run stopped."""
        self.storage.write_bytes(self.storage.path(STATE_FILE), state.to_json().encode())

    def complete(self) -> list[PurePath]:
        """Complete checkpoint folders, oldest first."""
        found = [p for p in self.storage.children(self.dir)
                 if _STEP_RE.fullmatch(p.name) and self.storage.is_file(p / MARKER)]
        return sorted(found, key=lambda p: int(_STEP_RE.fullmatch(p.name).group(1)))

    def latest(self) -> tuple[PurePath, DriverState] | None:
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
                if not self.storage.exists(path / MANIFEST):
                    raise DamagedCheckpoint(f"checkpoint {self.storage.uri(path)} (written before checkpoints had a "
                                            f"manifest) is damaged: {err}; remove that folder to resume from the one "
                                            "before it") from None
                _set_aside(self.storage, path, str(err))
        return None

    def load(self, path: PurePath) -> DriverState:
        """The driver state of checkpoint folder ``path`` once its files pass the checks; otherwise
        DamagedCheckpoint naming the file and what is wrong.

        With a ``manifest.json``, every file it lists must have its size (all compared first, a stat
        each) and its sha256: that reads the whole checkpoint once more, a cost paid at a resume or a
        learner restart, never at a save. A checkpoint without one was written before manifests: it is
        accepted when the files every checkpoint has are there (no sizes to compare them with) and its
        driver state reads.
        """
        manifest = self._manifest(path)
        if manifest is None:
            problem = _missing(self.storage, path, _LEGACY_FILES)
        else:
            problem = manifest.damage(path) if self.storage.local else _remote_damage(self.storage, path, manifest)
        if problem is not None:
            raise DamagedCheckpoint(problem)
        return DriverState.read(path / STATE_FILE, self.storage)

    def _manifest(self, path: PurePath) -> Manifest | None:
        """``Manifest.read`` of the folder, local or remote; DamagedCheckpoint when it does not read."""
        try:
            if self.storage.local:
                return Manifest.read(path)
            if not self.storage.exists(path / MANIFEST):
                return None
            try:
                return Manifest.from_json(self.storage.read_bytes(path / MANIFEST).decode("utf-8"))
            except (OSError, ValueError) as err:
                raise ValueError(f"{self.storage.uri(path / MANIFEST)} is not a valid manifest: {err}") from None
        except ValueError as err:
            raise DamagedCheckpoint(str(err)) from None

    def prune(self) -> None:
        """Delete all but the newest ``keep`` complete checkpoints.

        Damaged ones that ``latest`` found are set aside and not counted. Damage nobody has looked for
        (finding it takes a full read) is counted: a checkpoint that rots on disk after its save still
        takes one of the ``keep`` places until a resume or a restart finds it.
        """
        for old in self.complete()[:-self.keep]:
            try:
                self.storage.delete(old)
            except OSError as err:  # left for the next prune
                print(f"sliderl: warning: could not delete old checkpoint {self.storage.uri(old)}: {err}",
                      file=sys.stderr, flush=True)


def _missing(storage: Storage, path: PurePath, names: tuple[str, ...]) -> str | None:
    gone = [name for name in names if not storage.is_file(path / name)]
    return f"{storage.uri(path)} lacks {', '.join(gone)}" if gone else None


def _remote_damage(storage: Storage, folder: PurePath, manifest: Manifest) -> str | None:
    """``Manifest.damage`` for a folder in an object store: every listed file's size (a listing each) first,
    then its sha256 (one read each); the message names the object's URI."""
    for name, entry in manifest.files.items():
        size = storage.size(folder / name)
        if size is None:
            return f"{storage.uri(folder / name)} is missing"
        if size != entry.size:
            return f"{storage.uri(folder / name)} has {size} bytes where the manifest says {entry.size}"
    for name, entry in manifest.files.items():
        try:
            digest = storage.sha256(folder / name)
        except OSError as err:
            return f"{storage.uri(folder / name)} cannot be read ({err})"
        if digest != entry.sha256:
            return f"{storage.uri(folder / name)} does not match its sha256 in the manifest (its content changed)"
    return None


def _set_aside(storage: Storage, path: PurePath, why: str) -> None:
    """Rename a damaged checkpoint out of ``complete()``'s sight (replacing an earlier set-aside copy of
    the same step), with a warning naming it and why. In an object store the marker goes first, so an
    interrupted move leaves no complete folder behind."""
    aside = path.with_name(path.name + SET_ASIDE)
    try:
        storage.delete(aside)
        if not storage.local:
            storage.move(path / MARKER, aside / MARKER)
        storage.move(path, aside)
        where = f"set aside as {aside.name}"
    except OSError as err:
        where = f"could not be set aside ({err.strerror or err})"
    print(f"sliderl: warning: checkpoint {path.name} is damaged and skipped: {why}; {where}; trying the "
          "one before it", file=sys.stderr, flush=True)
