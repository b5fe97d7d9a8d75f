"""The identity of a set of coordinates: a 128-bit hash of its rows, computed where they live.

One pass of a Triton kernel on GPUs (kernels_src/plan_hash.py; torch ops on the CPU, same bits)
moves 16 bytes to the host. Each int64 word (two int32 coordinate entries) is XORed with its
position times an odd constant, so order matters, then scrambled by a splitmix64-style
finalizer; the words' sum modulo 2**64 is one 64-bit lane. Two lanes with independent constants
give 128 bits. A fast hash, not a cryptographic one: the plan cache's file header repeats N and
the geometry, and the loader checks them (cache/format.py).

Identities are remembered per tensor object and storage version, so the same unmodified tensor
is hashed once; the coordinate check (sparse_tensor.check_coords) computes the identity in the
same host sync as its verdict and leaves it here.
"""
from __future__ import annotations

import warnings

import torch

from .device_guard import on_device_of
from .kernels_src import plan_hash
from .launch_spec import INT64, SIZE
from .launcher import launch
from .tensor_memo import TensorMemo


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


def _programs(n_words: int) -> int:
    return max(-(-n_words // _TRITON_BLOCK), 1)


def launch_plan_hash(run, words: INT64, partial: INT64, n_words: SIZE) -> None:
    """partial [_programs(n_words), 2]: each program's two lane sums over its words. (The launch
    written once, for this module and the AOT build: flexplan/launch_spec.py.)"""
    run(plan_hash.plan_hash_kernel, (_programs(n_words),), words, partial, n_words,
        BLOCK=_TRITON_BLOCK)


def _lane_sums_triton(words: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    # One pass over the words instead of a dozen elementwise kernels (kernels_src/plan_hash.py).

    n_words = words.numel()
    partial = torch.empty((_programs(n_words), 2), dtype=torch.int64, device=words.device)
    launch_plan_hash(launch, words, partial, n_words)
    return partial.sum(dim=0) if out is None else torch.sum(partial, dim=0, out=out)


def digest_lanes(coords: torch.Tensor, use_triton: bool | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """int64 [2] on coords' device: the two 64-bit lanes over the coordinate rows, in order (a
    Triton kernel on GPUs, torch ops elsewhere; the same bits either way). No host sync.
    out: an int64 [2] tensor to write them to (e.g. next to other values read in one sync)."""
    global _triton_failed
    words = _words(coords)
    triton_path = (coords.is_cuda and not _triton_failed) if use_triton is None else use_triton
    if triton_path:
        try:
            with on_device_of(words):
                return _lane_sums_triton(words, out)
        except Exception as exc:  # noqa: BLE001 - a compile failure must not stop convolutions
            if use_triton:
                raise
            _triton_failed = True
            warnings.warn(f"flexplan plan cache: hash kernel unavailable ({exc!r}); hashing with "
                          "torch ops (same keys, slower)", RuntimeWarning, stacklevel=3)
    sums = _lane_sums_torch(words)
    return sums if out is None else out.copy_(sums)


def lanes_to_digest(values) -> tuple[int, int]:
    """The lanes read back (two ints, signed as torch holds them) as unsigned 64-bit ints."""
    return tuple(int(v) & ((1 << 64) - 1) for v in values)


def digest_identity(digest: tuple[int, int]) -> bytes:
    """The 16 bytes of an identity."""
    return b"".join(lane.to_bytes(8, "little") for lane in digest)


def coords_digest(coords: torch.Tensor, use_triton: bool | None = None) -> tuple[int, int]:
    """The two lanes as unsigned 64-bit ints (one host sync)."""
    return lanes_to_digest(digest_lanes(coords, use_triton).tolist())


# Identities of coordinate tensors already hashed, by object and version: the same unmodified
# tensor hashes once.
_identities = TensorMemo()


def known_identity(coords: torch.Tensor) -> bytes | None:
    """coords' identity if it was computed for this tensor object, not modified since (its
    version counter); else None."""
    return _identities.get(coords)


def coords_identity(coords: torch.Tensor) -> bytes:
    """16 bytes naming the coordinate rows: the two digest lanes (one host sync), or nothing to
    compute for a tensor hashed before and not modified since (its version counter)."""
    identity = known_identity(coords)
    if identity is not None:
        return identity
    identity = digest_identity(coords_digest(coords))
    remember_identity(coords, identity)
    return identity


def remember_identity(coords: torch.Tensor, identity: bytes) -> None:
    """Record coords' identity (computed elsewhere, e.g. with the coordinate check's readback).
    Not for inference tensors (made under torch.inference_mode): they keep no version counter,
    so a change in place could not be told; they are hashed again when asked."""
    _identities.put(coords, identity)
