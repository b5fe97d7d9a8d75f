"""The execution plan of one sparse convolution: everything the kernels need besides the data.

A plan is built once per (coordinates, geometry) and reused by every layer and call that sees the
same coordinates; the plan cache serializes it. Fields are tensors on one device; the object is
frozen and its dictionaries are read-only views.
"""
from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from types import MappingProxyType
from typing import Optional

import torch

from .geometry import ConvGeometry
from .graph_capture import capturing, device_constant
from .kernel_configs import SCHEDULE_CHUNK
from .launch_spec import INT32, SIZE
from .plan_tokens import register as _register_token

# Bump whenever a field's meaning or layout changes: the plan cache keys on it.
PLAN_FORMAT_VERSION = 3  # 2: submanifold plans keep the mirrored half of valid_signal
# 3: for_training (inference plans carry no backward parts)

# Missing neighbour marker in neighbor_map (int32 -1, the 0xffffffff of the FlexGEMM write-up).
MISSING = -1


def mirrored_signal_offsets(volume: int) -> int:
    """Offsets whose valid_signal pairs a submanifold plan keeps: those before the centre and
    the centre. The pairs of offset V - 1 - v are those of v with the roles swapped (the map is
    symmetric), so the rest would repeat them."""
    return volume // 2 + 1


# dtype -> [pinned chunk, slots handed out]: PendingCount's host copies are one-element views of
# a shared pinned chunk, never reused (a chunk is freed with its last view), instead of one
# pinned allocation each (about 60 us of a step's host time per count on a GPU host, 4 per
# fresh training step of bench_e2e's U-Net: scripts/results/host_costs.md, session 43).
_pinned_chunks: dict = {}
_PINNED_CHUNK_SLOTS = 512
_pinned_lock = threading.Lock()
# False: a pinned allocation per count, as before session 43 (A/B runs,
# scripts/bench_precision.py).
SHARED_PINNED_COUNTS = True


def _pinned_slot(dtype: torch.dtype) -> torch.Tensor:
    """A one-element pinned host tensor of dtype that no other caller gets."""
    with _pinned_lock:
        chunk = _pinned_chunks.get(dtype)
        if chunk is None or chunk[1] == _PINNED_CHUNK_SLOTS:
            # (outside inference mode: its later slots are written outside it too)
            with torch.inference_mode(False):
                chunk = _pinned_chunks[dtype] = [
                    torch.empty(_PINNED_CHUNK_SLOTS, dtype=dtype, pin_memory=True), 0]
        slot = chunk[1]
        chunk[1] = slot + 1
    return chunk[0][slot:slot + 1]


class PendingCount:
    """A count the device computes during a plan build, for the host to read later without a
    host sync of the stream: at the build, copied to pinned memory behind an event; read on
    first use, which waits only for that event (long passed by then: the build's own
    kernels), not for the work queued since. A build that must size nothing by the count
    leaves the host's launches running ahead of the GPU. Pickles as the number itself."""

    __slots__ = ("_host", "_event", "_device", "_value")

    def __init__(self, source: torch.Tensor):
        """source: a one-element integer tensor the work queued so far leaves the count in."""
        self._event = self._value = None
        self._device = source.device
        if source.is_cuda:
            self._host = (_pinned_slot(source.dtype) if SHARED_PINNED_COUNTS else
                          torch.empty(1, dtype=source.dtype, pin_memory=True))
            self._host.copy_(source.reshape(1), non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:  # kernels on the CPU (the interpreter) ran already: read when asked, as on a GPU
            self._host = source.reshape(1)

    @classmethod
    def known(cls, value: int) -> "PendingCount":
        count = cls.__new__(cls)
        count._host = count._event = count._device = None
        count._value = int(value)
        return count

    def value(self) -> int:
        # Thread-safe without a lock: the host copy and the event stay (8 bytes and an event),
        # so a second reader waiting beside the first reads the same number.
        value = self._value
        if value is None:
            if self._event is not None:
                if capturing(self._device):  # an event sync would invalidate the capture
                    raise RuntimeError(
                        "a plan's pair count is read by its first backward, which needs a host "
                        "wait that CUDA graph capture forbids: run one backward over this "
                        "plan before capturing (warm up, as torch advises for graphs)")
                self._event.synchronize()
            value = self._value = int(self._host[0])
        return value

    def __reduce__(self):
        return PendingCount.known, (self.value(),)


def maps_only_request(geometry: ConvGeometry, training: bool, scheduled: bool) -> bool:
    """Does a request of this kind get a maps-only plan (ConvPlan.maps_only)? Only strided
    inference requests that need no schedule (pools'); a submanifold, transposed or training
    request is built scheduled whatever it asks."""
    return not scheduled and not training and not geometry.submanifold and not geometry.transposed


def signal_fields(signal, device, training: bool) -> dict:
    """ConvPlan's valid_signal fields and for_training from a schedule's pairs: None, (input
    rows, output rows, seg), or those three with room past the pairs and the PendingCount of
    the pairs (pairs_pending). An inference plan (training False) has none (the schedule was
    asked for no pairs: any given are None)."""
    pending = None
    if not training:
        sig_i, sig_o, sig_seg = _no_pairs(torch.device(device))
    elif signal is None:
        sig_i = sig_o = sig_seg = None
    else:
        sig_i, sig_o, sig_seg, *rest = signal
        pending = rest[0] if rest else None
    return dict(valid_signal_i=sig_i, valid_signal_o=sig_o, valid_signal_seg=sig_seg,
                for_training=training, pairs_pending=pending)


def _no_pairs(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An inference plan's valid_signal fields: no pairs, seg [0]. Shared by every inference plan
    of the device (plans are never written to; two allocations fewer per build)."""
    def make():
        empty = torch.zeros(0, dtype=torch.int32, device=device)
        return empty, empty, torch.zeros(1, dtype=torch.int32, device=device)
    return device_constant("no_pairs", device, make)


class BlockRuns(Mapping):
    """Read-only block size -> tensor mapping whose tensors are runs of one buffer, each viewed
    on first use: a plan holds every block size, a layer reads one, and a view costs
    microseconds of host time (the Triton build is host-bound at small sizes).

    A run's length may be left to the device: (start, room, length_at) says the run lies within
    buffer[start:start + room] and its length is buffer[length_at], read (a host sync) only
    when the exact run is viewed. Kernels that find the run's end elsewhere (valid_kernel:
    through its seg) take `region`, which never syncs; a plan build then needs no sync to learn
    the lengths."""

    __slots__ = ("_buffer", "_runs", "_views")

    def __init__(self, buffer: torch.Tensor, runs: Mapping[int, tuple[int, ...]]):
        """runs: block size -> (start, length), or (start, room, length_at)."""
        self._buffer, self._runs, self._views = buffer, dict(runs), {}

    def __getitem__(self, block: int) -> torch.Tensor:
        view = self._views.get(block)
        if view is None:
            if len(self._runs[block]) == 3:
                self._read_lengths()
            start, length = self._runs[block]
            view = self._views[block] = self._buffer[start:start + length]
        return view

    def _read_lengths(self) -> None:
        """Every run's length still on the device, in one host sync (a file write or a move
        views them all)."""
        pending = [(block, run) for block, run in self._runs.items() if len(run) == 3]
        lengths = self._buffer[[run[2] for _, run in pending]].tolist()
        for (block, run), length in zip(pending, lengths):
            self._runs[block] = (run[0], length)

    @property
    def buffer(self) -> torch.Tensor:
        """The one tensor every run lies in."""
        return self._buffer

    def region(self, block: int) -> torch.Tensor:
        """The run, or for a run of unread length the room that holds it (no host sync)."""
        view = self._views.get(block)
        if view is not None:
            return view
        run = self._runs[block]
        if len(run) == 2:
            return self[block]
        room = ("room", block)  # kept too: a layer asks for it on every call
        view = self._views.get(room)
        if view is None:
            view = self._views[room] = self._buffer[run[0]:run[0] + run[1]]
        return view

    def __iter__(self):
        return iter(self._runs)

    def __len__(self) -> int:
        return len(self._runs)

    def __reduce__(self):  # plans cross process boundaries as plain dicts of views
        return dict, (dict(self),)


def _read_only(mapping: Mapping) -> Mapping:
    return mapping if isinstance(mapping, BlockRuns) else MappingProxyType(dict(mapping))


# GatherMap's derived views (derived and kept by flexplan/plan_views.py; this module only
# describes them). Each is one Triton launch (kernels_src/plan_views.py) where the
# launcher can run kernels (CUDA tensors, or any under TRITON_INTERPRET=1), else the torch
# expression, which is also the kernels' oracle. A plan derives them once per map, every step
# for a job with new coordinates, and those steps are host-bound: the torch expressions take 3
# device operations (sorted_map_t) and a sort of a dozen (chunk_order), one launch each here
# (scripts/results/host_costs.md). The AOT registry reads these settings.
SORTED_MAP_T_LAUNCH = dict(BLOCK=128, V_TILE=32, num_warps=4)
CHUNK_ORDER_LAUNCH = dict(TILE=128, num_warps=4)


def sorted_map_t_torch(neighbor_map: torch.Tensor, sorted_idx: torch.Tensor) -> torch.Tensor:
    """[V, M]: entry (v, i) is neighbor_map[sorted_idx[i], v]."""
    return neighbor_map[sorted_idx.long()].t().contiguous()


def chunk_order_torch(sorted_idx: torch.Tensor, chunk: int = SCHEDULE_CHUNK) -> torch.Tensor:
    """int32 [ceil(M / chunk)]: the full chunks of `chunk` sorted rows by ascending first row,
    then a partial last chunk."""
    m = sorted_idx.shape[0]
    full = m // chunk
    # int32 keys (rows): half the radix passes of int64; distinct, so any sort is stable.
    firsts = sorted_idx[:full * chunk:chunk].contiguous()
    order = torch.sort(firsts)[1].to(torch.int32)
    if m % chunk:
        order = torch.cat([order, order.new_full((1,), full)])
    return order


def _kernels():
    from .kernels_src import plan_views

    return plan_views


def kernels_interpreted() -> bool:
    """Whether the kernels are the interpreter's (TRITON_INTERPRET=1: they run over host copies
    of their tensors), as the launcher tells them apart."""
    from triton.runtime.jit import JITFunction

    return not isinstance(_kernels().sorted_map_t_kernel, JITFunction)


def kernels_run_on(t: torch.Tensor) -> bool:
    """Can launcher.launch run a kernel on t: a CUDA (or ROCm) tensor, or any tensor while the
    kernels are the interpreter's."""
    return t.is_cuda or kernels_interpreted()


# The views' launch descriptions: each launch written once (flexplan/launch_spec.py), for
# flexplan/plan_views.py, which launches them, and the AOT build (flexplan/aot/variants.py),
# which records them.

def launch_sorted_map_t(run, nmap: INT32, sorted_idx: INT32, out: INT32, m: SIZE,
                        v: SIZE) -> None:
    """out [v, m] = nmap [m, v] in sorted_idx's row order, transposed."""
    run(_kernels().sorted_map_t_kernel, (-(-m // SORTED_MAP_T_LAUNCH["BLOCK"]),), nmap,
        sorted_idx, out, m, v, **SORTED_MAP_T_LAUNCH)


def launch_chunk_order(run, sorted_idx: INT32, order: INT32, m: SIZE, chunk: int) -> None:
    """order [ceil(m / chunk)]: chunk_order_torch's."""
    chunks = -(-m // chunk)
    run(_kernels().chunk_order_kernel, (-(-chunks // CHUNK_ORDER_LAUNCH["TILE"]),), sorted_idx,
        order, m, CHUNK=chunk, **CHUNK_ORDER_LAUNCH)


@dataclass(frozen=True)
class GatherMap:
    """Rows of one side gather rows of the other side, one column per kernel offset.

    neighbor_map:     int32 [M, V]; entry (m, v) is the gathered row for offset v or MISSING.
    sorted_idx:       int32 [M]; rows in Gray-code order of their neighbour masks.
    valid_kernel:     block size -> int32 [L]; for each block of B sorted rows, the offsets
                      at least one row of the block has, concatenated block after block.
    valid_kernel_seg: block size -> int32 [ceil(M / B) + 1]; block i owns
                      valid_kernel[seg[i]:seg[i + 1]].
    Both mappings are read-only (BlockRuns, or proxies of the dicts given).

    derived_views:    name -> tensor: the views the kernels read, derived from the fields above
                      ("sorted_map_t" [V, M], "chunk_order"; "transposed_map" [N_in, V] for
                      a pool's backward over an inference plan; "masked_schedule", a GatherMap:
                      the same map scheduled, for a big convolution over a map built without
                      its schedule), kept with this map object once
                      made. The map never fills it itself (it is a passive value):
                      flexplan/plan_views.py derives each view on first use and keeps it here;
                      a planner whose kernels wrote sorted_map_t with the map puts it here as
                      it makes the map (with_sorted_map_t).
                      Not written to plan files, not pickled, not carried by map_tensors / to().
    launch_memo:      key -> what a convolution's launch over this map takes from it and from
                      dispatch (config, views), kept by flexplan/ops/conv.py for the map's next
                      calls of the same shape, and the map's views for a row block (shared by
                      every launch with that block); likewise never filled by the map, never written
                      or carried. It holds no storage of its own (views of the fields above and
                      of derived_views).
    """

    neighbor_map: torch.Tensor
    sorted_idx: torch.Tensor
    valid_kernel: Mapping[int, torch.Tensor]
    valid_kernel_seg: Mapping[int, torch.Tensor]
    derived_views: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    launch_memo: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "valid_kernel", _read_only(self.valid_kernel))
        object.__setattr__(self, "valid_kernel_seg", _read_only(self.valid_kernel_seg))

    @property
    def num_rows(self) -> int:
        return self.neighbor_map.shape[0]

    def kernel_offsets(self, block: int) -> torch.Tensor:
        """valid_kernel[block] for a kernel that reads it through valid_kernel_seg: possibly
        with room past its end, never a host sync (see BlockRuns.region)."""
        runs = self.valid_kernel
        return runs.region(block) if isinstance(runs, BlockRuns) else runs[block]

    @property
    def block_sizes(self) -> tuple[int, ...]:
        return tuple(sorted(self.valid_kernel))

    def held_tensors(self) -> list[torch.Tensor]:
        """Tensors whose storages this map keeps: the lazy runs' buffer, not their views (whose
        lengths may still be on the device: no host sync), and the derived views made so far."""
        held = [self.neighbor_map, self.sorted_idx]
        for runs in (self.valid_kernel, self.valid_kernel_seg):
            held.extend((runs.buffer,) if isinstance(runs, BlockRuns) else runs.values())
        for name, view in self.derived_views.items():
            if name == "full_schedule":  # this map's rows and map, and shared constants:
                held.extend(view.derived_views.values())  # only its own views are its
            elif isinstance(view, GatherMap):  # masked_schedule: a schedule of its own
                held.extend(view.held_tensors())
            else:
                held.append(view)
        return held

    def map_tensors(self, fn) -> "GatherMap":
        return GatherMap(fn(self.neighbor_map), fn(self.sorted_idx),
                         {b: fn(t) for b, t in self.valid_kernel.items()},
                         {b: fn(t) for b, t in self.valid_kernel_seg.items()})

    def to(self, device, non_blocking: bool = False) -> "GatherMap":
        return self.map_tensors(lambda t: t.to(device, non_blocking=non_blocking))

    def __reduce__(self):
        # mappingproxy does not pickle; DataLoader workers hand plans to the main process.
        return (GatherMap, (self.neighbor_map, self.sorted_idx, dict(self.valid_kernel),
                            dict(self.valid_kernel_seg)))


def with_sorted_map_t(gmap: GatherMap, map_t: torch.Tensor) -> GatherMap:
    """gmap, holding map_t as its sorted_map_t view: for a planner whose kernels wrote the map
    in sorted order [V, M] along with the map (the view's one launch saved), as it makes gmap."""
    gmap.derived_views["sorted_map_t"] = map_t
    return gmap


@dataclass(frozen=True)
class ConvPlan:
    """Execution plan of one sparse convolution.

    out[i] = sum_v W[:, v, :] @ in[fwd.neighbor_map[i, v]]  over the offsets v present.

    fwd:  output rows gather input rows (forward, and grad-weight pairs).
    bwd:  input rows gather output rows, for grad-input. None for submanifold convolutions:
          there the same map serves with the offsets reversed (v -> V - 1 - v), by symmetry.
    valid_signal_i / valid_signal_o: int32 [P]; the (input row, output row) pairs of the first
          S offsets, grouped by offset; valid_signal_seg int32 [S + 1] delimits each offset's
          pairs. S = V, or mirrored_signal_offsets(V) for submanifold plans (the pairs of the
          other offsets mirror these). Used for grad-weight: dW[v] = sum over the pairs of
          offset v of grad_out[o]^T in[i].
    out_coords: int32 [N_out, 4]; for submanifold convolutions the input coords themselves.
    for_training: False for a plan built for inference (no gradient will be taken): it has no
          valid_signal pairs (empty, S = 0) and, strided or transposed, a bwd map only where
          made for an inverse conv (planner.generative.bwd_from_fwd, or a graph-replayed build
          of a geometry an inverse conv asked that of before: planner.generative_graphs,
          INFER_BWD), else bwd None.
    maps_only (derived): a strided (not transposed) inference plan whose fwd map has no masked
          schedule (rows in their own order, planner.segments.unscheduled_map): what a pool
          reads (its windows), without the schedule's sort and launches. A convolution over
          it would run every offset of every block, so a conv's request is never served one
          (serves).
    pairs_pending: None, or the PendingCount P of the pairs while valid_signal_i / _o still
          hold room past them: a GPU build that sized them by a bound instead of waiting for
          its kernels (planner: a submanifold training build makes no host sync). num_pairs
          reads the count, `settled()` is the same plan with the exact views; the kernels
          read the pairs through valid_signal_seg and never need it. tensors(), map_tensors,
          to(), pin_memory and pickling give settled plans.
    """

    geometry: ConvGeometry
    batch_size: int
    in_spatial_shape: tuple[int, int, int]
    out_spatial_shape: tuple[int, int, int]
    num_in: int
    num_out: int
    out_coords: torch.Tensor
    fwd: GatherMap
    bwd: Optional[GatherMap]
    valid_signal_i: torch.Tensor
    valid_signal_o: torch.Tensor
    valid_signal_seg: torch.Tensor
    for_training: bool = True
    version: int = PLAN_FORMAT_VERSION
    pairs_pending: Optional[PendingCount] = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        # Indexed by its forward map, for the ops torch.compile puts in graphs (plan_tokens).
        _register_token(self)

    @property
    def kernel_volume(self) -> int:
        return self.geometry.volume

    @property
    def signal_offsets(self) -> int:
        """S: the offsets valid_signal holds pairs of; those from S on mirror offset V - 1 - v."""
        return self.valid_signal_seg.numel() - 1

    def serves(self, training: bool, scheduled: bool = True) -> bool:
        """Can this plan run a convolution that will (training) or will not be differentiated?
        scheduled=False: a pool's request, which a maps-only plan serves too."""
        return (self.for_training or not training) and not (scheduled and self.maps_only)

    @property
    def maps_only(self) -> bool:
        """Built for a pool's request (maps_only_request): no schedule of its fwd map."""
        # (An inverse conv's plan may have an unscheduled fwd map too: the paired conv's bwd
        # map. Its bwd map is the paired fwd map, scheduled; a maps-only plan's bwd map, where
        # its inverse conv made one, is never scheduled: planner.generative.bwd_from_fwd.)
        return (not self.for_training and not self.geometry.submanifold
                and not self.geometry.transposed and not self.fwd.valid_kernel_seg
                and (self.bwd is None or not self.bwd.valid_kernel_seg))

    @property
    def schedule_deferred(self) -> bool:
        """A submanifold inference plan built without the masked schedule of its fwd map (a
        first sighting's, where the plan cache defers it: its convs run every offset of every
        block, plan_views.full_schedule); planner.scheduled_plan makes the scheduled plan of it."""
        return (not self.for_training and self.geometry.submanifold and self.num_in > 0
                and not self.fwd.valid_kernel_seg)

    @property
    def num_pairs(self) -> int:
        """All (input row, output row) pairs of the convolution, mirrored ones included (the
        centre's pairs, one per output row, are their own mirror)."""
        stored = (int(self.valid_signal_i.numel()) if self.pairs_pending is None
                  else self.pairs_pending.value())
        return stored if self.signal_offsets == self.kernel_volume else 2 * stored - self.num_out

    def settled(self) -> "ConvPlan":
        """This plan with valid_signal_i / _o the exact pairs (itself when they are)."""
        if self.pairs_pending is None:
            return self
        pairs = self.pairs_pending.value()
        return replace(self, valid_signal_i=self.valid_signal_i[:pairs],
                       valid_signal_o=self.valid_signal_o[:pairs], pairs_pending=None)

    @property
    def device(self) -> torch.device:
        return self.fwd.neighbor_map.device

    def map_tensors(self, fn) -> "ConvPlan":
        """The same plan, settled, with fn applied to every tensor."""
        plan = self.settled()
        return replace(plan, out_coords=fn(plan.out_coords), fwd=plan.fwd.map_tensors(fn),
                       bwd=None if plan.bwd is None else plan.bwd.map_tensors(fn),
                       valid_signal_i=fn(plan.valid_signal_i),
                       valid_signal_o=fn(plan.valid_signal_o),
                       valid_signal_seg=fn(plan.valid_signal_seg))

    def to(self, device, non_blocking: bool = False) -> "ConvPlan":
        """The same plan with every tensor on `device` (pinned sources copy asynchronously)."""
        return self.map_tensors(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> "ConvPlan":
        """Page-locked copy; DataLoader(pin_memory=True) calls this on plans in a batch."""
        return self.map_tensors(lambda t: t.pin_memory())

    def held_tensors(self) -> list[torch.Tensor]:
        """Tensors whose storages the plan keeps alive (GatherMap.held_tensors): what it costs
        in memory, found without a host sync."""
        held = [self.out_coords, self.valid_signal_i, self.valid_signal_o, self.valid_signal_seg]
        for gmap in (self.fwd, self.bwd):
            if gmap is not None:
                held.extend(gmap.held_tensors())
        return held

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor of the settled plan under a flat, stable name (for serialization and
        equality)."""
        plan = self.settled()
        out: dict[str, torch.Tensor] = {}
        for f in fields(plan):
            value = getattr(plan, f.name)
            if isinstance(value, torch.Tensor):
                out[f.name] = value
            elif isinstance(value, GatherMap):
                out[f"{f.name}.neighbor_map"] = value.neighbor_map
                out[f"{f.name}.sorted_idx"] = value.sorted_idx
                for b in value.block_sizes:
                    out[f"{f.name}.valid_kernel.{b}"] = value.valid_kernel[b]
                    out[f"{f.name}.valid_kernel_seg.{b}"] = value.valid_kernel_seg[b]
        return out

    def __reduce__(self):
        # Settled, the pairs copied out of their room: pickle writes a view's whole storage.
        plan = self
        if self.pairs_pending is not None:
            plan = self.settled()
            plan = replace(plan, valid_signal_i=plan.valid_signal_i.clone(),
                           valid_signal_o=plan.valid_signal_o.clone())
        return ConvPlan, tuple(getattr(plan, f.name) for f in fields(plan))
