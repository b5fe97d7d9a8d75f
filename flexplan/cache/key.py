"""Cache key of a plan: a 128-bit hash of everything the plan depends on.

The coordinates are hashed where they live, in one pass of a Triton kernel on GPUs (torch ops on
the CPU, same bits), so the key costs a small fraction of building the plan and moves 16 bytes
to the host.
Each int64 word (two int32 coordinate entries) is XORed with its position times an odd constant,
so order matters, then scrambled by a splitmix64-style finalizer; the words' sum modulo 2**64 is
one 64-bit lane. Two lanes with independent constants give 128 bits. The scalars (N, batch size,
spatial shape, every geometry field, plan and file format versions) are hashed with blake2b
together with the lanes. This is a fast hash, not a cryptographic one: the file header repeats
N and the geometry and the loader checks them (see format.py and disk.py).
"""
from __future__ import annotations

import functools
import hashlib
import json
import warnings
import weakref
from dataclasses import asdict

import torch

from ..geometry import ConvGeometry
from ..plan import PLAN_FORMAT_VERSION
from .format import FILE_FORMAT_VERSION


def _signed(value: int) -> int:
    """A 64-bit constant as the int64 torch holds it."""
    return value - (1 << 64) if value >= 1 << 63 else value


# (position multiplier, finalizer multipliers) per lane; splitmix64 and murmur3 fmix64 constants.
_LANES = (
    (_signed(0x9E3779B97F4A7C15), _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB)),
    (_signed(0xC2B2AE3D27D4EB4F), _signed(0xFF51AFD7ED558CCD), _signed(0xC4CEB9FE1A85EC53)),
)


def _shift_right_logical(x: torch.Tensor, bits: int) -> torch.Tensor:
    # torch's >> on int64 is arithmetic; mask the sign-extended bits away.
    return (x >> bits) & ((1 << (64 - bits)) - 1)


_TRITON_BLOCK = 4096
_triton_failed = False  # set once if the kernel cannot compile here


def _words(coords: torch.Tensor) -> torch.Tensor:
    """The coordinate rows as int64 words (two int32 entries each), in order."""
    flat = coords.contiguous().reshape(-1)
    if flat.numel() % 2:  # pad to whole int64 words (never for [N, 4] int32)
        flat = torch.cat([flat, flat.new_zeros(1)])
    return flat.view(torch.int64) if flat.element_size() == 4 else flat.to(torch.int64)


def _lane_sums_torch(words: torch.Tensor) -> torch.Tensor:
    # Both lanes as rows of one [2, W] tensor: one set of kernel launches.
    step, mul1, mul2 = torch.tensor(_LANES, dtype=torch.int64, device=words.device).t()[:, :, None]
    position = torch.arange(words.numel(), device=words.device, dtype=torch.int64)
    x = words ^ (position * step)  # int64 products wrap modulo 2**64 on CPU and GPU
    x = x ^ _shift_right_logical(x, 30)
    x = x * mul1
    x = x ^ _shift_right_logical(x, 27)
    x = x * mul2
    x = x ^ _shift_right_logical(x, 31)
    return x.sum(dim=1)


def _lane_sums_triton(words: torch.Tensor) -> torch.Tensor:
    # One pass over the words instead of a dozen elementwise kernels (kernels_src/plan_hash.py).
    from ..kernels_src import plan_hash
    from ..launcher import launch

    programs = max(-(-words.numel() // _TRITON_BLOCK), 1)
    partial = torch.empty((programs, 2), dtype=torch.int64, device=words.device)
    launch(plan_hash.plan_hash_kernel, (programs,), words, partial, words.numel(), BLOCK=_TRITON_BLOCK)
    return partial.sum(dim=0)


def coords_digest(coords: torch.Tensor, use_triton: bool | None = None) -> tuple[int, int]:
    """Two 64-bit lanes over the coordinate rows, in order, computed on coords' device (a Triton
    kernel on GPUs, torch ops elsewhere; the same bits either way)."""
    global _triton_failed
    words = _words(coords)
    triton_path = (coords.is_cuda and not _triton_failed) if use_triton is None else use_triton
    if triton_path:
        try:
            sums = _lane_sums_triton(words)
        except Exception as exc:  # noqa: BLE001 - a compile failure must not stop convolutions
            if use_triton:
                raise
            _triton_failed = True
            warnings.warn(f"flexplan plan cache: hash kernel unavailable ({exc!r}); hashing with "
                          "torch ops (same keys, slower)", RuntimeWarning, stacklevel=3)
            sums = _lane_sums_torch(words)
    else:
        sums = _lane_sums_torch(words)
    return tuple(int(v) & ((1 << 64) - 1) for v in sums.tolist())  # one sync


# Identities of coordinate tensors already hashed, by object: the same tensor (same storage
# version) hashes once. A weak reference: a freed tensor's id may be reused by another.
_identities: dict[int, tuple[weakref.ref, int, bytes]] = {}


def coords_identity(coords: torch.Tensor) -> bytes:
    """16 bytes naming the coordinate rows: the two digest lanes (one host sync), or nothing to
    compute for a tensor hashed before and not modified since (its version counter)."""
    ident = id(coords)
    known = _identities.get(ident)
    if known is not None and known[0]() is coords and known[1] == coords._version:
        return known[2]
    identity = b"".join(lane.to_bytes(8, "little") for lane in coords_digest(coords))
    try:
        ref = weakref.ref(coords, lambda _, ident=ident: _identities.pop(ident, None))
    except TypeError:  # a tensor subclass without weak references: hash every time
        return identity
    _identities[ident] = (ref, coords._version, identity)
    return identity


def derived_identity(parent: bytes, spatial_shape, batch_size: int, geometry: ConvGeometry) -> bytes:
    """The identity of the output coordinates of `geometry` over the coordinates named `parent`
    (a strided or transposed conv's out_coords are a function of those four), with no device
    work: flexplan's own outputs are never hashed."""
    scalars = {"derived_from": parent.hex(), "spatial_shape": [int(s) for s in spatial_shape],
               "batch_size": int(batch_size), "geometry": asdict(geometry)}
    return hashlib.blake2b(json.dumps(scalars, sort_keys=True).encode(), digest_size=16).digest()


def plan_key(coords: torch.Tensor, spatial_shape, batch_size: int, geometry: ConvGeometry,
             identity: bytes | None = None, training: bool = True) -> str:
    """32 hex digits naming the plan of `geometry` over `coords` (any device, same key).
    identity: coords_identity(coords) or a derived_identity, when the caller has it.
    training: False names the inference plan (ConvPlan.for_training), a plan of its own."""
    h = hashlib.blake2b(_scalars_bytes(str(coords.dtype), int(batch_size),
                                       tuple(int(s) for s in spatial_shape), geometry,
                                       bool(training)), digest_size=16)
    h.update(b"".join(int(n).to_bytes(8, "little") for n in coords.shape))
    h.update(coords_identity(coords) if identity is None else identity)
    return h.hexdigest()


@functools.lru_cache(maxsize=1024)
def _scalars_bytes(dtype: str, batch_size: int, spatial_shape: tuple, geometry: ConvGeometry,
                   training: bool) -> bytes:
    """The JSON of a key's scalars but the row count: a job has few combinations, so this costs
    a dict lookup per key instead of dataclass and JSON encoding."""
    fields = {
        "plan_version": PLAN_FORMAT_VERSION, "file_version": FILE_FORMAT_VERSION,
        "coords_dtype": dtype, "batch_size": batch_size,
        "spatial_shape": list(spatial_shape), "geometry": asdict(geometry),
    }
    if not training:
        fields["inference"] = True
    return json.dumps(fields, sort_keys=True).encode()
