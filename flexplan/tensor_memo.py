"""Values remembered per tensor object while the tensor is unmodified, at the bottom of the
package (it imports nothing of flexplan).

An entry holds a weak reference to its tensor and the tensor's version counter when the value
was put: a get answers only for the same living object at the same version, so a change in
place (which bumps the counter) or a freed tensor whose id another took both miss. Inference
tensors (made under torch.inference_mode) keep no version counter and are never remembered.
A tensor subclass that takes no weak reference is not remembered either.

Used for what costs device work or a host sync to learn about a coordinate tensor: its
identity (coords_hash), the grids it passed the coordinate check on (coords_check), a 2D / 1D
tensor's indices with the unit axes added (nn.sparse_conv_tensor).

The contract: coordinates are changed through torch ops (which bump the version counter).
Writes that bypass the counter (`tensor.data[...] = ...`, a NumPy or DLPack alias, a kernel
writing through data_ptr, a collective received into a reused buffer) are not seen: the
tensor keeps its remembered identity, check and padded copy. A job that writes coordinates
that way passes new tensors, or sets FLEXPLAN_TENSOR_MEMO=0 (read at import: nothing is
remembered, every tensor is hashed and checked at every use).
"""
from __future__ import annotations

import os
import weakref

import torch

# False (FLEXPLAN_TENSOR_MEMO=0): nothing is remembered (see the module's docstring).
ENABLED = os.environ.get("FLEXPLAN_TENSOR_MEMO", "1").strip() != "0"


class TensorMemo:
    """One value per tensor object and version (see the module's docstring)."""

    __slots__ = ("_entries", "_max_entries", "__weakref__")

    def __init__(self, max_entries: int | None = None):
        """max_entries: keep at most this many, dropping the oldest (for values that hold
        memory, e.g. a tensor: the memo must not keep a copy of every tensor a job wraps);
        None: entries go only with their tensors."""
        self._entries: dict[int, tuple[weakref.ref, int, object]] = {}
        self._max_entries = max_entries

    def get(self, tensor: torch.Tensor):
        """The value put for this tensor object at its current version, else None. In a
        bounded memo a hit makes the entry the newest (a tensor used every step stays)."""
        if not ENABLED or tensor.is_inference():
            return None
        ident = id(tensor)
        entry = self._entries.get(ident)
        if entry is not None and entry[0]() is tensor and entry[1] == tensor._version:
            if self._max_entries is not None:
                try:
                    self._entries[ident] = self._entries.pop(ident)
                except KeyError:  # (its tensor's callback, or another thread, took it)
                    pass
            return entry[2]
        return None

    def put(self, tensor: torch.Tensor, value) -> None:
        """Remember value for tensor at its current version (replacing what was there)."""
        if not ENABLED or tensor.is_inference():
            return
        ident, entries = id(tensor), self._entries
        try:
            # (the entry leaves with its tensor: the callback runs before the id can be reused)
            ref = weakref.ref(tensor, lambda _, ident=ident: entries.pop(ident, None))
        except TypeError:
            return
        entries.pop(ident, None)  # (re-put: to the newest place)
        entries[ident] = (ref, tensor._version, value)
        if self._max_entries is not None and len(entries) > self._max_entries:
            try:  # the oldest; its weak reference goes with it, its callback never runs
                del entries[next(iter(entries))]
            except (StopIteration, KeyError, RuntimeError):  # (another thread changed it)
                pass

    def __len__(self) -> int:
        return len(self._entries)
