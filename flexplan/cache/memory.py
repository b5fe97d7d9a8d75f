"""In-process layer: least-recently-used plans, bounded by the bytes their tensors hold.

Entries are keyed by (plan key, device), since a plan's tensors live on one device. Entries put
with pinned=True (plans a server loaded with load_plans) are never evicted, only cleared.

Plans of a key's first sighting go to a ring of the RECENT_PLANS latest instead (put_recent): a
repeat soon after (the same coordinates asked for again in the same step) finds them and moves
them to the LRU, while a stream of coordinates seen once (augmented scans, a scan per request)
neither fills the LRU, nor holds GPU memory, nor pays its per-entry accounting. A plan the
ring drops is freed in the host's next wait on the GPU (host_waits.py), not in the step's time. Where no one
else tells a first sighting from a repeat (no disk cache to consult: admit), the memory
remembers the keys of its last SEEN_KEYS plans: a key built again goes to the LRU.
"""
from __future__ import annotations

import threading
from collections import OrderedDict

import torch

from ..host_waits import release_later, release_now
from ..plan import ConvPlan


def held_bytes(plan: ConvPlan) -> int:
    """Bytes of the storages behind the plan's tensors, each counted once: a tensor may be a view
    of a larger buffer (the Triton planner's valid_kernel of every block size shares one buffer
    sized for the worst case), and the buffer is what stays allocated. The gather maps' derived
    views (plan_views.sorted_map_t, the size of the map, and chunk_order, a fraction of it) are
    counted as made, since the first convolution makes them after the plan is put."""
    storages = {}
    for t in plan.held_tensors():
        storage = t.untyped_storage()
        storages[(t.device, storage.data_ptr())] = storage.nbytes()
    derived = sum(gmap.neighbor_map.nbytes for gmap in (plan.fwd, plan.bwd)
                  if gmap is not None and not _has_map_view(gmap))
    return sum(storages.values()) + derived


def _has_map_view(gmap) -> bool:
    """Whether the map's sorted_map_t is made, on it or on a schedule derived from it (the one
    its convolutions run over: plan_views.full_schedule / masked_schedule)."""
    return "sorted_map_t" in gmap.derived_views or any(
        "sorted_map_t" in getattr(view, "derived_views", ()) for view in gmap.derived_views.values())


RECENT_PLANS = 16
SEEN_KEYS = 4096  # keys only (~100 bytes each): a job's plans per step, many times over


class MemoryCache:
    def __init__(self, max_bytes: int):
        self.max_bytes = int(max_bytes)
        self._entries: OrderedDict[tuple[str, torch.device], tuple[ConvPlan, int, bool]] = OrderedDict()
        self._recent: OrderedDict[tuple[str, torch.device], ConvPlan] = OrderedDict()
        self._seen: OrderedDict[tuple[str, torch.device], None] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()  # DataLoader threads and user threads may share the cache

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str, device: torch.device) -> ConvPlan | None:
        with self._lock:
            entry = self._entries.get((key, device))
            if entry is not None:
                self._entries.move_to_end((key, device))
                return entry[0]
            plan = self._recent.get((key, device))
        if plan is not None:  # back soon after its first sighting: into the LRU
            self._promote(key, plan)
        return plan

    def _promote(self, key: str, plan: ConvPlan) -> None:
        """Move a plan from the ring to the LRU in one locked step (a concurrent replace or get
        finds it in one of the two)."""
        size = held_bytes(plan)  # (reads tensor storages: outside the lock)
        slot = (key, plan.device)
        with self._lock:
            if self._recent.get(slot) is not plan:
                return  # another thread moved or replaced it
            del self._recent[slot]
            if size > self.max_bytes:
                return  # would evict everything else and still not fit
            old = self._entries.pop(slot, None)
            if old is not None:
                self._bytes -= old[1]
            self._entries[slot] = (plan, size, False)
            self._bytes += size
            self._evict()

    def put_recent(self, key: str, plan: ConvPlan) -> None:
        """Keep the plan of a key's first sighting in the ring of recent ones (and its key with
        the seen ones: built again, it is a repeat)."""
        dropped = None
        with self._lock:
            slot = (key, plan.device)
            self._recent[slot] = plan
            if len(self._recent) > RECENT_PLANS:
                dropped = self._recent.popitem(last=False)[1]
            self._note_seen(slot)
        if dropped is not None:  # (freed in the host's next wait on the GPU: host_waits.py)
            release_later(dropped)

    def _note_seen(self, slot) -> bool:
        """Note slot among the seen keys (the latest SEEN_KEYS); whether it was there (locked)."""
        again = slot in self._seen
        if not again:
            self._seen[slot] = None
            if len(self._seen) > SEEN_KEYS:
                self._seen.popitem(last=False)
        return again

    def was_seen(self, key: str, device: torch.device) -> bool:
        """Whether a plan of (key, device) was kept before (admit and put_recent note keys)."""
        with self._lock:
            return (key, device) in self._seen

    def admit(self, key: str, plan: ConvPlan) -> None:
        """Keep a plan just built: in the LRU if its key was seen before (its plan dropped from
        the ring or evicted), else in the ring of recent ones."""
        slot = (key, plan.device)
        with self._lock:
            again = self._note_seen(slot)
        if again:
            self.put(key, plan)
        else:
            self.put_recent(key, plan)

    def put(self, key: str, plan: ConvPlan, pinned: bool = False) -> None:
        size = held_bytes(plan)
        if size > self.max_bytes and not pinned:
            return  # would evict everything else and still not fit
        with self._lock:
            old = self._entries.pop((key, plan.device), None)
            if old is not None:
                self._bytes -= old[1]
            self._entries[(key, plan.device)] = (plan, size, pinned)
            self._bytes += size
            self._evict()

    def replace(self, key: str, old: ConvPlan, new: ConvPlan) -> bool:
        """Where (key, device) holds `old`, in the LRU or the ring, hold `new` in its place
        (the same plan with more made: see PlanCache.refine). Whether it did."""
        slot = (key, old.device)
        with self._lock:
            entry = self._entries.get(slot)
            if entry is not None and entry[0] is old:
                size = held_bytes(new)
                self._entries[slot] = (new, size, entry[2])
                self._bytes += size - entry[1]
                self._evict()
                return True
            if self._recent.get(slot) is old:
                self._recent[slot] = new
                return True
        return False

    def _evict(self) -> None:
        if self._bytes <= self.max_bytes:  # the usual case: no walk over the entries
            return
        victims = []
        for slot, (_, size, pinned) in self._entries.items():
            if self._bytes <= self.max_bytes:
                break
            if not pinned:
                victims.append(slot)
                self._bytes -= size
        for slot in victims:
            del self._entries[slot]

    def resize(self, max_bytes: int) -> None:
        with self._lock:
            self.max_bytes = int(max_bytes)
            self._evict()

    def items(self):
        with self._lock:
            return [(key, plan) for (key, _), (plan, _, _) in self._entries.items()]

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._recent.clear()
            self._seen.clear()
            self._bytes = 0
        release_now()  # (and the plans dropped before, waiting for a host wait: host_waits.py)
