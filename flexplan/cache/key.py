"""Cache key of a plan: a 128-bit hash of everything the plan depends on.

The coordinates are named by their identity (flexplan/coords_hash.py: 128 bits hashed where they
live, or derived from the coordinates they were computed from); the scalars (N, batch size,
spatial shape, every geometry field, plan and file format versions) are hashed with blake2b
together with it. The file header repeats N and the geometry and the loader checks them (see
format.py and disk.py).
"""
from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import asdict

import torch

from ..coords_hash import coords_digest, coords_identity  # noqa: F401 - the key's API
from ..geometry import ConvGeometry
from ..plan import PLAN_FORMAT_VERSION
from .format import FILE_FORMAT_VERSION


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
