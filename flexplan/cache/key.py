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
import re
from dataclasses import asdict

import torch

from ..compile_boundary import opaque
from ..coords_hash import coords_digest, coords_identity  # noqa: F401 - the key's API
from ..geometry import ConvGeometry
from ..plan import PLAN_FORMAT_VERSION
from .format import FILE_FORMAT_VERSION


@opaque
def derived_identity(parent: bytes, spatial_shape, batch_size: int, geometry: ConvGeometry) -> bytes:
    """The identity of the output coordinates of `geometry` over the coordinates named `parent`
    (a strided or transposed conv's out_coords are a function of those four), with no device
    work: flexplan's own outputs are never hashed."""
    h = hashlib.blake2b(_derived_scalars(tuple(int(s) for s in spatial_shape), int(batch_size),
                                         geometry), digest_size=16)
    h.update(parent)
    return h.digest()


@functools.lru_cache(maxsize=1024)
def _derived_scalars(spatial_shape: tuple, batch_size: int, geometry: ConvGeometry) -> bytes:
    """derived_identity's scalars as JSON: a job has few, so a dict lookup per strided layer."""
    return json.dumps({"derived_from": True, "spatial_shape": list(spatial_shape),
                       "batch_size": batch_size, "geometry": asdict(geometry)},
                      sort_keys=True).encode()


def plan_key(coords: torch.Tensor, spatial_shape, batch_size: int, geometry: ConvGeometry,
             identity: bytes | None = None, training: bool = True, maps_only: bool = False) -> str:
    """32 hex digits naming the plan of `geometry` over `coords` (any device, same key).
    identity: coords_identity(coords) or a derived_identity, when the caller has it.
    training: False names the inference plan (ConvPlan.for_training), a plan of its own;
    maps_only (with training False) the maps-only plan (ConvPlan.maps_only), another."""
    return key_from_identity(coords.shape[0], spatial_shape, batch_size, geometry,
                             coords_identity(coords) if identity is None else identity, training,
                             coords_dtype=coords.dtype, coords_columns=coords.shape[1],
                             maps_only=maps_only)


def key_from_identity(num_rows: int, spatial_shape, batch_size: int, geometry: ConvGeometry,
                      identity: bytes, training: bool = True, *,
                      coords_dtype: torch.dtype = torch.int32, coords_columns: int = 4,
                      maps_only: bool = False) -> str:
    """plan_key from the coordinates' row count and identity alone: what a plan file's
    recorded identity must hash to, with the plan's own scalars (identity_binding_problem)."""
    h = hashlib.blake2b(_scalars_bytes(str(coords_dtype), int(batch_size),
                                       tuple(int(s) for s in spatial_shape), geometry,
                                       bool(training), bool(maps_only)), digest_size=16)
    h.update(int(num_rows).to_bytes(8, "little") + int(coords_columns).to_bytes(8, "little"))
    h.update(identity)
    return h.hexdigest()


IDENTITY_FIELD = "coords_identity"  # the plan file header's record of the input coordinates
_HEX_IDENTITY = re.compile(r"[0-9a-f]{32}")


def identity_binding_problem(key: str, header: dict, plan) -> str | None:
    """None if the plan file binds to its key: the identity of the input coordinates recorded in
    its header, hashed with the plan's own row count and scalars, gives `key`. A plan of other
    coordinates (a strided plan of the same row count, say) filed under this key fails: it
    would otherwise be served for coordinates it was not built from. No device work."""
    recorded = header.get(IDENTITY_FIELD)
    if not isinstance(recorded, str) or not _HEX_IDENTITY.fullmatch(recorded):
        return "the file records no identity of its input coordinates"
    if key_from_identity(plan.num_in, plan.in_spatial_shape, plan.batch_size, plan.geometry,
                         bytes.fromhex(recorded), plan.for_training,
                         maps_only=plan.maps_only) != key:
        return "its input coordinates' identity does not hash to its key (a plan of other coordinates)"
    return None


@functools.lru_cache(maxsize=1024)
def _scalars_bytes(dtype: str, batch_size: int, spatial_shape: tuple, geometry: ConvGeometry,
                   training: bool, maps_only: bool = False) -> bytes:
    """The JSON of a key's scalars but the row count: a job has few combinations, so this costs
    a dict lookup per key instead of dataclass and JSON encoding."""
    fields = {
        "plan_version": PLAN_FORMAT_VERSION, "file_version": FILE_FORMAT_VERSION,
        "coords_dtype": dtype, "batch_size": batch_size,
        "spatial_shape": list(spatial_shape), "geometry": asdict(geometry),
    }
    if not training:
        fields["inference"] = True
    if maps_only:  # (absent otherwise: the other plans' keys stay what they were)
        fields["maps_only"] = True
    return json.dumps(fields, sort_keys=True).encode()
