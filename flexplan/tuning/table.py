"""Tuned tables on disk: one JSON file per (GPU, Triton version).

    {"schema": 1, "device": {"name", "arch", "sms", "triton"}, "torch": "...", "created": "...",
     "entries": {"<bucket key>": {"config": {KernelConfig fields}, "ms": t, "heuristic_ms": t,
                                  "trials": k}}}

Tables live in the user cache dir (flexplan.paths.tuning_dir(), written by `python -m flexplan
tune` and by run-time tuning) and inside the package (flexplan/tuning/tables/, for known GPUs).
Writes are atomic (flexplan.atomic_write) under a file lock, so concurrent tuners merge their
entries instead of losing them.
"""
from __future__ import annotations

import datetime
import json
import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from ..atomic_write import atomic_write
from ..kernel_configs import CANDIDATE_AXES, KernelConfig, heuristic_config
from .. import paths
from ..paths import tuning_dir
from .buckets import Bucket
from .device import DeviceKey

SCHEMA_VERSION = 1
_CONFIG_FIELDS = tuple(f.name for f in fields(KernelConfig))


class TableError(ValueError):
    """A table file that cannot be used: unreadable, bad JSON, unknown schema, bad entries."""


@dataclass(frozen=True)
class Entry:
    config: KernelConfig
    ms: float            # median time of the config when tuned
    heuristic_ms: float  # median time of the heuristic default in the same run
    trials: int          # configs measured

    def to_json(self) -> dict:
        return {"config": asdict(self.config), "ms": self.ms, "heuristic_ms": self.heuristic_ms,
                "trials": self.trials}


@dataclass
class TuningTable:
    device: DeviceKey
    entries: dict  # Bucket -> Entry

    def to_json(self) -> dict:
        import torch

        return {"schema": SCHEMA_VERSION, "device": self.device.to_json(),
                "torch": torch.__version__,
                "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "entries": {b.key: e.to_json() for b, e in sorted(self.entries.items(),
                                                                  key=lambda item: item[0].key)}}

    @classmethod
    def from_json(cls, data) -> "TuningTable":
        if not isinstance(data, dict):
            raise TableError("not a JSON object")
        if data.get("schema") != SCHEMA_VERSION:
            raise TableError(f"schema {data.get('schema')!r}, this flexplan reads {SCHEMA_VERSION}")
        try:
            device = DeviceKey.from_json(data.get("device"))
            raw = data["entries"]
            entries = {Bucket.parse(key): _entry(Bucket.parse(key), value)
                       for key, value in raw.items()}
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise TableError(str(err)) from None
        return cls(device, entries)


def _entry(bucket: Bucket, value) -> Entry:
    """Parse one entry and check its config is one the ops may launch for the bucket: the
    bucket's heuristic default, or a config of the family's candidate space."""
    cfg = value["config"]
    if not isinstance(cfg, dict) or set(cfg) != set(_CONFIG_FIELDS):
        raise ValueError(f"{bucket}: config fields {sorted(cfg)} != {sorted(_CONFIG_FIELDS)}")
    config = KernelConfig(**{k: int(cfg[k]) for k in _CONFIG_FIELDS})
    problem = bucket.representative()
    if config != heuristic_config(problem.family, problem):
        axes = CANDIDATE_AXES[problem.family]
        for name in _CONFIG_FIELDS:
            if getattr(config, name) not in axes[name]:
                raise ValueError(f"{bucket}: {name}={getattr(config, name)} is not a candidate")
        if config.splitk > 1 and not problem.splitk_allowed:
            raise ValueError(f"{bucket}: split-K config for algorithm {bucket.algo!r}")
    return Entry(config, float(value["ms"]), float(value["heuristic_ms"]), int(value["trials"]))


def read_table(path) -> TuningTable:
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise TableError(f"cannot read: {err}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise TableError(f"bad JSON: {err}") from None
    return TuningTable.from_json(data)


def write_table(table: TuningTable, path) -> Path:
    """Atomically replace `path` with `table` (under the file lock)."""
    from filelock import FileLock

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path) + ".lock"):
        _replace(path, table)
    return path


def merge_into(path, table: TuningTable) -> TuningTable:
    """Add `table`'s entries to the table at `path` (same device key; else it is replaced),
    atomically under the file lock; returns what was written."""
    from filelock import FileLock

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path) + ".lock"):
        merged = TuningTable(table.device, {})
        try:
            old = read_table(path)
            if old.device == table.device:
                merged.entries.update(old.entries)
        except TableError:
            pass  # missing or unusable: start over
        merged.entries.update(table.entries)
        _replace(path, merged)
    return merged


def _replace(path: Path, table: TuningTable) -> None:
    with atomic_write(path, "w", prefix=path.name, suffix=".tmp") as f:
        json.dump(table.to_json(), f, indent=1)
        f.write("\n")


def user_table_path(device: DeviceKey) -> Path:
    """Where this machine keeps its own tuned table for `device`."""
    return tuning_dir() / f"{device.slug}.json"


def shipped_table_paths() -> list[Path]:
    return sorted(paths.shipped_tables_dir().glob("*.json"))
