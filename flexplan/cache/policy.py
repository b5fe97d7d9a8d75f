"""When the disk layer is worth it: a plan goes to disk only if its key comes back, and only if
loading it beats rebuilding it.

Admission (mode auto): most coordinates of a real job are seen once (augmented scans, a new scan
per request), so a key's first sighting builds the plan and keeps it in memory only: no plan
file read, no lock, no write. Only a key seen before -- in this process, or in any process
sharing the directory, through the journal of seen keys (admission.py) -- takes the disk path:
load the file, else build under the key's lock and store it if the cost model below says so.
A second epoch or a second run writes; the next one loads. Mode always stores every plan (and
journals its key, so auto processes load it); mode never has no disk and no journal; save_plans /
load_plans are not affected.

Cost model: loading costs a fixed latency plus bytes over a bandwidth (read, checksum,
host-to-device copy); building costs time per voxel-offset on the device. The load rates start
from defaults measured on the H100 machine (scripts/results/bench_cache.md); both are refined by
every build and load this process times, and a file's header carries its own build time.

Settings come from the environment (read at import; a bad mode warns and means auto) and can be
changed through the API:

    FLEXPLAN_PLAN_CACHE            auto (default) | always | never  (never: memory layer only)
    FLEXPLAN_PLAN_CACHE_MAX_BYTES  disk cap, e.g. 8G (default), 500M; LRU eviction beyond it
    FLEXPLAN_PLAN_CACHE_MEMORY     in-process cap, e.g. 2G (default)
"""
from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field

MODE_ENV = "FLEXPLAN_PLAN_CACHE"
MAX_DISK_ENV = "FLEXPLAN_PLAN_CACHE_MAX_BYTES"
MAX_MEMORY_ENV = "FLEXPLAN_PLAN_CACHE_MEMORY"
MODES = ("auto", "always", "never")

# Defaults until this process has timed its own loads, per target device type: file in the page
# cache, read + crc32 (+ pinned host-to-device copy), measured on the H100 machine (bench_cache.md).
_LOAD_LATENCY_S = {"cpu": 0.5e-3, "cuda": 1.5e-3}
_LOAD_BYTES_PER_S = {"cpu": 0.75e9, "cuda": 1.8e9}
# A stored plan must save at least this factor, so that noise never makes a hit slower.
STORE_MARGIN = 1.5
_EMA = 0.5  # weight of the newest measurement


def parse_bytes(text: str | int) -> int:
    """'8G', '500M', '64k' or a plain number of bytes."""
    if isinstance(text, int):
        return text
    s = str(text).strip().upper().removesuffix("B").removesuffix("I")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}.get(s[-1:], 1)
    try:
        value = float(s[:-1] if scale > 1 else s) * scale
    except ValueError:
        raise ValueError(f"cannot read a byte size from {text!r} (use e.g. 8G, 500M, 4096)") from None
    if value < 0:
        raise ValueError(f"byte size must be >= 0, got {text!r}")
    return int(value)


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"plan cache mode {mode!r}; choose one of {MODES}")
    return mode


def _env_mode() -> str:
    mode = os.environ.get(MODE_ENV, "auto").strip().lower() or "auto"
    if mode not in MODES:  # a typo in the environment must not break `import flexplan`
        warnings.warn(f"{MODE_ENV}={mode!r} is not one of {MODES}; using auto", RuntimeWarning,
                      stacklevel=2)
        return "auto"
    return mode


@dataclass
class Policy:
    mode: str = field(default_factory=_env_mode)
    max_disk_bytes: int = field(default_factory=lambda: parse_bytes(os.environ.get(MAX_DISK_ENV, "8G")))
    max_memory_bytes: int = field(default_factory=lambda: parse_bytes(os.environ.get(MAX_MEMORY_ENV, "2G")))
    # Learned rates, by device type: seconds per voxel-offset to build, seconds per byte to load.
    build_s_per_unit: dict = field(default_factory=dict)
    load_s_per_byte: dict = field(default_factory=lambda: {k: 1 / v for k, v in _LOAD_BYTES_PER_S.items()})

    def __post_init__(self):
        check_mode(self.mode)

    def _load_estimate(self, device_type: str, nbytes: int) -> float:
        latency = _LOAD_LATENCY_S.get(device_type, _LOAD_LATENCY_S["cuda"])
        per_byte = self.load_s_per_byte.get(device_type, self.load_s_per_byte["cuda"])
        return latency + nbytes * per_byte

    def record_build(self, device_type: str, work: int, seconds: float) -> None:
        rate = seconds / max(work, 1)
        old = self.build_s_per_unit.get(device_type)
        self.build_s_per_unit[device_type] = rate if old is None else _EMA * rate + (1 - _EMA) * old

    def record_load(self, device_type: str, nbytes: int, seconds: float) -> None:
        latency = _LOAD_LATENCY_S.get(device_type, _LOAD_LATENCY_S["cuda"])
        if nbytes < (1 << 20):  # small files measure the latency, not the bandwidth
            return
        rate = max(seconds - latency, 0.0) / nbytes
        old = self.load_s_per_byte.get(device_type, rate)
        self.load_s_per_byte[device_type] = _EMA * rate + (1 - _EMA) * old

    def worth_storing(self, device_type: str, build_seconds: float, nbytes: int) -> bool:
        """After a build of an admitted key (seen before): write the plan to disk?"""
        if self.mode != "auto":
            return self.mode == "always"
        return build_seconds > STORE_MARGIN * self._load_estimate(device_type, nbytes)

    def build_beats_any_load(self, device_type: str, work: int) -> bool:
        """A build timed on this device type beats loading even the smallest possible file
        (the fixed latency plus the int32 neighbour map, 4 bytes per voxel-offset): skip the
        disk, its header reads and its build lock, whatever file may be there."""
        per_unit = self.build_s_per_unit.get(device_type)
        if self.mode != "auto" or per_unit is None:
            return False
        return per_unit * work < self._load_estimate(device_type, 4 * work)

    def worth_loading(self, device_type: str, work: int, nbytes: int, header: dict) -> bool:
        """Before a build, with a file of `nbytes` on disk: load it rather than rebuild?

        The file's header says how long its build took and on what device type; a build timed
        on this device type (there or in this process) is what loading must beat.
        """
        if self.mode != "auto":
            return self.mode == "always"
        load = self._load_estimate(device_type, nbytes)
        if header.get("built_on") == device_type:
            return load < float(header.get("build_seconds", 0.0))
        per_unit = self.build_s_per_unit.get(device_type)
        if per_unit is None:
            return True  # nothing timed on this device type yet; the writer judged it worth it
        return load < per_unit * work
