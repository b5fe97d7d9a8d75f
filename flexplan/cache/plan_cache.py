"""PlanCache: the in-process LRU in front of the shared disk directory, and the build-once path."""
from __future__ import annotations

import os
import re
import threading
import time
import warnings
import weakref
from collections import Counter
from pathlib import Path
from typing import Iterable, Mapping

import torch

from ..graph_capture import capturing
from ..atomic_write import atomic_write
from .. import paths
from ..geometry import ConvGeometry, triple
from ..plan import ConvPlan, maps_only_request
from ..coords_check import SparseTensorError, check_coords
from .admission import SeenKeys
from .disk import DiskCache
from ..coords_hash import coords_identity
from .disk import read_bound_plan
from .format import SUFFIX, PlanFileError, plan_nbytes, write_plan
from .key import IDENTITY_FIELD, key_from_identity, plan_key
from .memory import MemoryCache
from .policy import Policy, check_mode


# Whether a submanifold inference plan's first sighting is built without the masked schedule
# of its map (ConvPlan.schedule_deferred), scheduled when its key comes back. Coordinates
# seen once (a fresh scan per request) skip the schedule's sort and launches, host time in a
# host-bound step, and run every offset of every block (plan_views.full_schedule); repeated
# ones get their schedule from their second sighting on (scripts/results/bench_precision.md,
# session 39).
DEFER_FIRST_SCHEDULE = True


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


_KEY = re.compile(r"[0-9a-f]{32}")


def _given_key(key: str) -> str:
    # A caller's key names a file and a journal line: it must look like plan_key's.
    if not isinstance(key, str) or not _KEY.fullmatch(key):
        raise ValueError(f"plan cache key must be 32 lowercase hex digits, got {key!r}")
    return key


def _check_layout(coords) -> None:
    # The key hashes the raw int32 rows; anything else must fail here, not hash differently.
    if not isinstance(coords, torch.Tensor) or coords.dtype != torch.int32 or coords.dim() != 2 \
            or coords.shape[1] != 4:
        raise SparseTensorError("coords must be an int32 torch.Tensor of shape [N, 4], got "
                                f"{getattr(coords, 'dtype', type(coords).__name__)} "
                                f"{tuple(getattr(coords, 'shape', ()))}")


def _matches(plan: ConvPlan, coords, spatial_shape, batch_size, geometry, training=True,
             maps_only: bool = False) -> bool:
    """Does a loaded plan belong to this request? Guards against key collisions."""
    if (plan.geometry != geometry or plan.batch_size != batch_size or plan.num_in != coords.shape[0]
            or plan.for_training != training or plan.maps_only != maps_only
            or tuple(plan.in_spatial_shape) != tuple(spatial_shape)):
        return False
    # Submanifold plans carry their input coords: compare them exactly (cheap next to a load).
    return not geometry.submanifold or torch.equal(plan.out_coords, coords)


def _check_key_names_plan(key: str, plan: ConvPlan) -> None:
    """A submanifold plan carries its coordinates: its key must be theirs, or a shipped file
    could serve other coordinates with the same row count (PlanFileError). (A strided plan
    keeps only its outputs; its key cannot be recomputed from the file.)"""
    if plan.geometry.submanifold and plan_key(
            plan.out_coords, plan.in_spatial_shape, plan.batch_size, plan.geometry,
            training=plan.for_training) != key:
        raise PlanFileError(f"the plan's coordinates do not hash to its key {key}")


class PlanCache:
    """Plans by key: memory (per process, LRU by bytes), then disk (shared, LRU by bytes).

    directory: the disk layer's directory; None follows flexplan.paths.plan_cache_dir(), i.e.
    $FLEXPLAN_CACHE_DIR/plans or the per-user cache directory.
    In mode auto a key goes to the disk layer only on its second sighting (policy.py,
    admission.py); until then a miss builds and keeps the plan in memory.
    """

    def __init__(self, directory: str | os.PathLike | None = None, policy: Policy | None = None):
        self.policy = policy or Policy()
        self.memory = MemoryCache(self.policy.max_memory_bytes)
        self._directory = directory
        self._disks: dict[Path, DiskCache] = {}
        self._admissions: dict[Path, SeenKeys] = {}
        self._counts: Counter = Counter()
        self._seconds: Counter = Counter()
        # id(plan) -> (plan, key, identity of its input coordinates or None), for save_plans
        self._keys: dict[int, tuple[weakref.ref, str, bytes | None]] = {}
        self._lock = threading.Lock()

    # ---- configuration -------------------------------------------------------------------
    @property
    def directory(self) -> Path:
        return Path(self._directory) if self._directory is not None else paths.plan_cache_dir()

    @property
    def disk(self) -> DiskCache:
        directory = self.directory
        disk = self._disks.get(directory)
        if disk is None:
            disk = self._disks[directory] = DiskCache(directory, self.policy.max_disk_bytes)
        disk.max_bytes = self.policy.max_disk_bytes
        return disk

    @property
    def admission(self) -> SeenKeys:
        """The keys seen so far (this process and the directory's journal)."""
        directory = self.directory
        seen = self._admissions.get(directory)
        if seen is None:
            seen = self._admissions[directory] = SeenKeys(directory)
        return seen

    def configure(self, *, mode: str | None = None, directory: str | os.PathLike | None = None,
                  max_disk_bytes: int | None = None, max_memory_bytes: int | None = None) -> None:
        """Change settings at run time (defaults come from the environment, see policy.py)."""
        if mode is not None:
            self.policy.mode = check_mode(mode)
        if directory is not None:
            self._directory = directory
        if max_disk_bytes is not None:
            self.policy.max_disk_bytes = int(max_disk_bytes)
        if max_memory_bytes is not None:
            self.policy.max_memory_bytes = int(max_memory_bytes)
            self.memory.resize(max_memory_bytes)

    # ---- bookkeeping ---------------------------------------------------------------------
    def _count(self, what: str, seconds: float | None = None) -> None:
        with self._lock:
            self._counts[what] += 1
            if seconds is not None:
                self._seconds[what] += seconds

    def _remember(self, key: str, plan: ConvPlan, identity: bytes | None = None) -> ConvPlan:
        ident = id(plan)
        with self._lock:
            self._keys[ident] = (weakref.ref(plan, lambda _: self._keys.pop(ident, None)), key,
                                 identity)
        return plan

    def key_of(self, plan: ConvPlan) -> str | None:
        """The key of a plan this cache handed out, if it is still alive."""
        ref, key, _ = self._keys.get(id(plan), (None, None, None))
        return key if ref is not None and ref() is plan else None

    def refine(self, plan: ConvPlan, refined: ConvPlan) -> ConvPlan:
        """Where this cache handed out `plan`, later lookups of its key get `refined`: the same
        plan with more made (an inference plan with the bwd map its inverse conv made), so
        that the work is done once per plan, not once per call. Returns `refined`."""
        ref, key, identity = self._keys.get(id(plan), (None, None, None))
        if ref is not None and ref() is plan and self.memory.replace(key, plan, refined):
            self._remember(key, refined, identity)
        return refined

    def _identity_of(self, key: str, plan: ConvPlan) -> bytes | None:
        """The identity remembered with a plan this cache handed out under `key`, if any."""
        ref, known_key, identity = self._keys.get(id(plan), (None, None, None))
        return identity if ref is not None and ref() is plan and known_key == key else None

    def _binding(self, key: str, plan: ConvPlan, coords=None,
                 identity: bytes | None = None) -> dict | None:
        """The header field that binds a plan file to its key (the identity of the plan's input
        coordinates), or None where that identity is unknown: given, remembered, or hashed from
        the coordinates (the request's, or a submanifold plan's own), and checked against the
        key. A plan that cannot be bound is not written: its file could not be trusted."""
        if identity is None:
            identity = self._identity_of(key, plan)
        def candidates():  # cheapest first: hashing coordinates costs a launch and a sync
            if identity is not None:
                yield identity
            if coords is not None:
                yield coords_identity(coords)
            if plan.geometry.submanifold:
                yield coords_identity(plan.out_coords)

        for candidate in candidates():
            if key_from_identity(plan.num_in, plan.in_spatial_shape, plan.batch_size,
                                 plan.geometry, candidate, plan.for_training,
                                 maps_only=plan.maps_only) == key:
                return {IDENTITY_FIELD: candidate.hex()}
        return None

    def stats(self) -> dict:
        """Counts (memory/disk hits, misses, builds, first sightings kept off the disk, disk
        writes, corrupt files, ...), seconds spent per kind of event, the bytes held in memory
        and on disk, and the seen keys (this process + journal) and the journal's bytes."""
        with self._lock:
            out = dict(self._counts)
            out.update({f"{k}_seconds": v for k, v in self._seconds.items()})
        disk = self.disk
        out.update(memory_bytes=self.memory.nbytes, memory_entries=len(self.memory),
                   disk_bytes=disk.total_bytes(), disk_writable=disk.writable,
                   directory=str(disk.directory), mode=self.policy.mode)
        out.update(self.admission.stats())
        return out

    def clear(self, disk: bool = False) -> None:
        """Forget the in-memory plans and the counters; with disk=True delete the files, the
        journal of seen keys and this process's sightings too."""
        self.memory.clear()
        with self._lock:
            self._counts.clear()
            self._seconds.clear()
        if disk:
            self.disk.clear()
            self.admission.clear()

    # ---- lookups -------------------------------------------------------------------------
    def key(self, coords, spatial_shape, batch_size, geometry, training: bool = True,
            identity: bytes | None = None, maps_only: bool = False) -> str:
        _check_layout(coords)
        start = time.perf_counter()
        key = plan_key(coords, triple(spatial_shape, "spatial_shape"), batch_size, geometry,
                       identity, training=training, maps_only=maps_only)
        self._count("keys", time.perf_counter() - start)
        return key

    def _load(self, key, coords, shape, batch_size, geometry, locked: bool, training: bool = True,
              maps_only: bool = False):
        """(plan, None) from disk, or (None, why): "absent", "skipped" (rebuilding is faster
        here), "bad" (corrupt or foreign file; removed with a warning when locked)."""
        disk, device = self.disk, coords.device
        work = coords.shape[0] * geometry.volume
        file_bytes = []

        def accept(header, nbytes):
            file_bytes.append(nbytes)
            return self.policy.worth_loading(device.type, work, nbytes, header)

        start = time.perf_counter()
        try:
            plan, header = disk.load(key, device, accept)
        except (PlanFileError, OSError) as exc:
            if locked:  # unlocked, a writer may be replacing it: decide under the lock
                self._count("corrupt")
                warnings.warn(f"flexplan plan cache: {disk.path(key)} is unusable ({exc}); "
                              "removing it and rebuilding", RuntimeWarning, stacklevel=4)
                disk.remove(key)
            return None, "bad"
        if plan is None:
            if header is None:
                return None, "absent"
            self._count("disk_skipped")
            return None, "skipped"
        _sync(device)
        seconds = time.perf_counter() - start
        if not _matches(plan, coords, shape, batch_size, geometry, training, maps_only):
            self._count("collisions")  # the build below overwrites it
            return None, "bad"
        self.policy.record_load(device.type, file_bytes[0], seconds)
        self._count("disk_hits", seconds)
        self.memory.put(key, plan)
        return self._remember(key, plan, bytes.fromhex(header[IDENTITY_FIELD])), None

    def _memory_get(self, key, device) -> ConvPlan | None:
        plan = self.memory.get(key, device)
        if plan is not None:
            self._count("memory_hits")
        return plan

    def get(self, coords, spatial_shape, batch_size: int, geometry: ConvGeometry,
            key: str | None = None) -> ConvPlan | None:
        """The cached plan (memory, then disk) or None; never builds (nor records a sighting).
        key: the plan's key if the caller has it (the coordinates are then not hashed)."""
        shape = triple(spatial_shape, "spatial_shape")
        key = _given_key(key) if key is not None else self.key(coords, shape, batch_size, geometry)
        plan = self._memory_get(key, coords.device)
        if plan is None and self.policy.mode != "never":
            plan, _ = self._load(key, coords, shape, batch_size, geometry, locked=False)
        return plan

    def put(self, coords, spatial_shape, batch_size: int, geometry: ConvGeometry, plan: ConvPlan,
            key: str | None = None, build_seconds: float | None = None,
            identity: bytes | None = None) -> str:
        """Cache a plan built elsewhere, in memory and (unless mode is never) on disk; with
        build_seconds, on disk only where the policy finds loading it faster than that.
        identity: of coords, where the caller has it (a derived one: see key.derived_identity)."""
        shape = triple(spatial_shape, "spatial_shape")
        key = key or self.key(coords, shape, batch_size, geometry, plan.for_training, identity,
                              plan.maps_only)
        self.memory.put(key, plan)
        store = (self.policy.mode != "never" if build_seconds is None else
                 self.policy.worth_storing(plan.device.type, build_seconds, plan_nbytes(plan)))
        binding = self._binding(key, plan, coords, identity) if store else None
        if binding is not None:
            identity = bytes.fromhex(binding[IDENTITY_FIELD])
        elif identity is None:  # keep what an earlier caller told us
            identity = self._identity_of(key, plan)
        self._remember(key, plan, identity)
        if store and binding is None:
            self._count("unbound")  # no identity hashes to this key: not written
        elif store:
            extra = {"built_on": plan.device.type, "build_seconds": build_seconds or 0.0,
                     **binding}
            if self.disk.store(key, plan, extra):
                self._count("disk_writes")
                self.admission.record(key)  # a file to find: auto processes should look
        return key

    def _build(self, key, coords, shape, batch_size, geometry, backend, store: bool,
               training: bool = True, keep: bool | None = True,
               identity: bytes | None = None, maps_only: bool = False,
               deferred: bool = False) -> ConvPlan:
        """Build, count, and cache: on disk (store) and in memory: the LRU (store or keep), the
        ring of first sightings (keep False), or as MemoryCache.admit decides (keep None).
        deferred: a submanifold inference plan without its schedule (ConvPlan.schedule_deferred)."""
        from ..planner import build_plan

        self._count("misses")
        # Timing a build waits for the GPU to finish it (and everything queued before it): only
        # where the time decides something, a store, or the first build of a device type (the
        # rate build_beats_any_load compares; not a deferred build, cheaper than the scheduled
        # ones that rate stands for). A fresh-coordinate job's builds then overlap.
        timed = store or (not deferred
                          and self.policy.build_s_per_unit.get(coords.device.type) is None)
        start = time.perf_counter()
        plan = build_plan(coords, shape, batch_size, geometry, backend=backend, check=False,
                          training=training, scheduled=not (maps_only or deferred))
        if timed:
            _sync(coords.device)
            seconds = time.perf_counter() - start
            self._count("builds", seconds)
            self.policy.record_build(coords.device.type, coords.shape[0] * geometry.volume, seconds)
        else:
            self._count("builds")
        if store:
            self.put(coords, shape, batch_size, geometry, plan, key=key, build_seconds=seconds,
                     identity=identity)
        else:
            if keep is None:  # no admission decided: the memory's own record of keys
                self.memory.admit(key, plan)
            elif keep:
                self.memory.put(key, plan)
            else:  # a first sighting: the ring of recent plans, not the LRU (memory.py)
                self.memory.put_recent(key, plan)
            self._remember(key, plan, identity)
        return plan

    def get_or_build(self, coords, spatial_shape, batch_size: int, geometry: ConvGeometry, *,
                     backend: str = "auto", check: bool = True, key: str | None = None,
                     training: bool = True, identity: bytes | None = None,
                     scheduled: bool = True) -> ConvPlan:
        """The plan of `geometry` over `coords`: from memory, from disk, or built (once across
        processes sharing the directory) and cached. In mode auto a key's first sighting builds
        and keeps the plan in memory only; the disk is for keys that come back.
        key: the plan's key if the caller derived it (the coordinates are then not hashed).
        identity: the coordinates' identity (coords_hash, or key.derived_identity for
        coordinates a strided layer made): the key is derived from it, and a plan file records
        it to bind to its key; without key and identity the coordinates are hashed.
        training: False asks for an inference plan (ConvPlan.for_training; its own key).
        scheduled: False (a pool's request) asks, where the geometry is strided or transposed
        and training False, for a maps-only plan (ConvPlan.maps_only; its own key)."""
        _check_layout(coords)
        maps_only = maps_only_request(geometry, training, scheduled)
        shape = triple(spatial_shape, "spatial_shape")
        if check:
            check_coords(coords, shape, batch_size)
        if key is None:  # the key from the identity (hashed here if not given), both kept
            identity = identity if identity is not None else coords_identity(coords)
            key = self.key(coords, shape, batch_size, geometry, training, identity, maps_only)
        else:
            key = _given_key(key)
        plan = self._memory_get(key, coords.device)
        if plan is not None:
            return self._served(key, plan)
        if capturing(coords.device):  # made for the capture alone (graph_capture.py)
            from ..planner import build_plan

            return build_plan(coords, shape, batch_size, geometry, backend=backend, check=False,
                              training=training, scheduled=not maps_only)
        args = (key, coords, shape, batch_size, geometry)
        kind = dict(training=training, maps_only=maps_only)
        built = dict(kind, identity=identity)
        work = coords.shape[0] * geometry.volume
        # A first sighting's submanifold inference plan: its schedule deferred (DEFER_FIRST_SCHEDULE)
        deferrable = DEFER_FIRST_SCHEDULE and geometry.submanifold and not training
        if self.policy.mode == "never" or self.policy.build_beats_any_load(coords.device.type, work):
            deferred = deferrable and not self.memory.was_seen(key, coords.device)
            return self._build(*args, backend, store=False, keep=None, deferred=deferred, **built)
        if self.policy.mode == "auto" and not self.admission.seen_before(key):
            # Likely never back: no file read, no lock, no write, no LRU entry.
            self._count("first_sightings")
            return self._build(*args, backend, store=False, keep=False, deferred=deferrable,
                               **built)
        plan, why = self._load(*args, locked=False, **kind)
        if plan is not None:
            return self._served(key, plan)
        if why == "skipped":  # on disk already, but rebuilding is faster here
            return self._build(*args, backend, store=False, **built)
        with self.disk.build_lock(key):
            plan, why = self._load(*args, locked=True, **kind)  # the previous holder may have stored it
            return self._served(key, plan) if plan is not None else self._build(
                *args, backend, store=why != "skipped", **built)

    def _served(self, key: str, plan: ConvPlan) -> ConvPlan:
        """A cached plan as a lookup hands it out: one whose schedule was deferred (a first
        sighting's) comes back scheduled, for this and every later lookup of its key. Not
        during a CUDA graph capture: a schedule made there would be kept with nothing written
        in it until the graph replays (graph_capture.py)."""
        if not plan.schedule_deferred or capturing(plan.device):
            return plan
        from ..planner import scheduled_plan

        self._count("deferred_schedules")
        scheduled = scheduled_plan(plan)
        self.memory.replace(key, plan, scheduled)
        self._remember(key, scheduled, self._identity_of(key, plan))
        return scheduled

    # ---- shipping plans with a model -----------------------------------------------------
    def save_plans(self, directory: str | os.PathLike,
                   plans: Mapping[str, ConvPlan] | Iterable[ConvPlan]) -> list[str]:
        """Write plans (key -> plan, or plans this cache handed out) to `directory`; their keys."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        items = plans.items() if isinstance(plans, Mapping) else [(self.key_of(p), p) for p in plans]
        keys = []
        for key, plan in items:
            if key is None:
                raise ValueError("save_plans: a plan was not made by this plan cache (or was "
                                 "freed); pass a {key: plan} mapping, keys from plan_cache.key()")
            plan = self._served(key, plan)  # shipped plans serve repeats: scheduled, as repeats get
            binding = self._binding(key, plan)
            if binding is None:
                raise ValueError(f"save_plans: plan {key} cannot be bound to its coordinates "
                                 "(a strided plan this cache did not hand out under this key)")
            # (readable by others: shipped plans are read by every node's job)
            with atomic_write(directory / f"{key}{SUFFIX}", suffix=SUFFIX,
                              permissions=0o644) as out:
                write_plan(out, plan, key, binding)
            keys.append(key)
        return keys

    def load_plans(self, directory: str | os.PathLike, device=None) -> dict[str, ConvPlan]:
        """Load every plan file of `directory` onto `device` and keep them in memory for good
        (never evicted); cached_plan then finds them. Bad files are reported and skipped."""
        device = torch.empty(0, device=device).device  # "cuda" -> "cuda:0", as coords report it
        loaded = {}
        for path in sorted(Path(directory).glob(f"*{SUFFIX}")):
            if path.name.startswith(".tmp-"):
                continue
            try:
                plan, header = read_bound_plan(path, device, path.name.removesuffix(SUFFIX))
                _check_key_names_plan(header["key"], plan)
            except (PlanFileError, OSError) as exc:
                warnings.warn(f"flexplan.load_plans: skipping {path} ({exc})", RuntimeWarning,
                              stacklevel=2)
                continue
            self.memory.put(header["key"], plan, pinned=True)
            loaded[header["key"]] = self._remember(header["key"], plan,
                                                   bytes.fromhex(header[IDENTITY_FIELD]))
        return loaded

