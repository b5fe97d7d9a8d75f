"""The plan file: a versioned, checksummed, pickle-free serialization of one ConvPlan.

Layout (little endian):
    prefix   MAGIC (8 bytes), file format version, header length, header crc32, 0   (u32 each)
    header   UTF-8 JSON: key, plan version, every non-tensor ConvPlan field, build facts,
             payload crc32, and for each tensor its name, dtype, stored dtype, shape, offset
    payload  starts 64-byte aligned; each tensor's raw bytes, 64-byte aligned

Integer tensors are stored in the narrowest of int8/int16/int32 that holds their values and widened
on the target device after the copy, which shrinks the file and the host-to-device copy. A file is
read with one readinto() into (pinned, for CUDA targets) host memory; the tensors are views of it.
"""
from __future__ import annotations

import json
import os
import struct
import zlib
from dataclasses import asdict, fields
from typing import BinaryIO, Callable

import torch

from ..device_guard import on_device_of
from ..geometry import ConvGeometry
from ..launch_spec import INT32, INT64, SIZE
from ..plan import (PLAN_FORMAT_VERSION, ConvPlan, GatherMap, kernels_run_on,
                    mirrored_signal_offsets)

MAGIC = b"FXPLAN\x00\x01"
FILE_FORMAT_VERSION = 2  # 2: the header records the input coordinates' identity (key.py)
SUFFIX = ".fxplan"
_PREFIX = struct.Struct("<8sIIII")
_ALIGN = 64
_MAX_HEADER_BYTES = 1 << 24  # refuse absurd lengths from corrupt prefixes before allocating

_DTYPES = {str(d): d for d in (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8,
                               torch.bool, torch.float16, torch.bfloat16, torch.float32)}
_NARROW = (torch.int8, torch.int16, torch.int32)


class PlanFileError(ValueError):
    """The file is not a valid plan file of this version (corrupt, truncated, foreign)."""


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _narrowest(t: torch.Tensor) -> torch.dtype:
    if t.dtype not in (torch.int32, torch.int64) or t.numel() == 0:
        return t.dtype
    lo, hi = int(t.min()), int(t.max())
    for dtype in _NARROW:
        info = torch.iinfo(dtype)
        if info.min <= lo and hi <= info.max:
            return dtype
    return t.dtype


def _stored_fields():
    """ConvPlan's fields a file holds: not the build-time state (pairs_pending, compare=False:
    a written plan is settled)."""
    return [f for f in fields(ConvPlan) if f.compare]


def plan_meta(plan: ConvPlan) -> dict:
    """Every non-tensor field of the plan, JSON-ready."""
    meta = {}
    for f in _stored_fields():
        value = getattr(plan, f.name)
        if isinstance(value, ConvGeometry):
            meta[f.name] = asdict(value)
        elif f.name not in ("fwd", "bwd") and not isinstance(value, torch.Tensor):
            meta[f.name] = list(value) if isinstance(value, tuple) else value
    # (tensors go to the payload; a bwd of None is the absence of bwd.* tensors)
    return meta


def _gather_map(tensors: dict, prefix: str) -> GatherMap | None:
    if f"{prefix}.neighbor_map" not in tensors:
        return None
    kernels, segs = {}, {}
    for name, t in tensors.items():
        head, _, block = name.rpartition(".")
        if head == f"{prefix}.valid_kernel":
            kernels[int(block)] = t
        elif head == f"{prefix}.valid_kernel_seg":
            segs[int(block)] = t
    return GatherMap(tensors[f"{prefix}.neighbor_map"], tensors[f"{prefix}.sorted_idx"], kernels, segs)


def plan_from_parts(meta: dict, tensors: dict[str, torch.Tensor]) -> ConvPlan:
    """Inverse of (plan_meta(plan), plan.tensors())."""
    values = {}
    for f in _stored_fields():
        if f.name == "geometry":
            values[f.name] = ConvGeometry(**{k: tuple(v) if isinstance(v, list) else v
                                             for k, v in meta[f.name].items()})
        elif f.name in tensors:
            values[f.name] = tensors[f.name]
        elif f.name in ("fwd", "bwd"):
            values[f.name] = _gather_map(tensors, f.name)
        else:
            value = meta[f.name]
            values[f.name] = tuple(value) if isinstance(value, list) else value
    if values["fwd"] is None:
        raise PlanFileError("plan has no fwd gather map")
    return ConvPlan(**values)


def plan_nbytes(plan: ConvPlan) -> int:
    return sum(t.numel() * t.element_size() for t in plan.tensors().values())


def write_plan(out: BinaryIO, plan: ConvPlan, key: str, extra: dict | None = None) -> int:
    """Serialize `plan` into the open binary file `out`; returns the bytes written."""
    host = {name: t.detach().cpu().contiguous() for name, t in plan.tensors().items()}
    entries, blobs, offset, crc = [], [], 0, 0
    for name, t in host.items():
        stored = _narrowest(t)
        data = t.to(stored) if stored != t.dtype else t
        raw = data.reshape(-1).view(torch.uint8).numpy() if data.numel() else b""
        pad = _aligned(len(raw)) - len(raw)
        entries.append({"name": name, "dtype": str(t.dtype), "stored": str(stored),
                        "shape": list(t.shape), "offset": offset, "nbytes": len(raw)})
        for chunk in (raw, b"\0" * pad):
            crc = zlib.crc32(chunk, crc)
            blobs.append(chunk)
        offset += len(raw) + pad
    header = {"key": key, "plan_version": PLAN_FORMAT_VERSION, "meta": plan_meta(plan),
              "payload_bytes": offset, "payload_crc32": crc, "tensors": entries, **(extra or {})}
    head = json.dumps(header, separators=(",", ":")).encode()
    prefix = _PREFIX.pack(MAGIC, FILE_FORMAT_VERSION, len(head), zlib.crc32(head), 0)
    gap = _aligned(_PREFIX.size + len(head)) - _PREFIX.size - len(head)
    out.write(prefix + head + b"\0" * gap)
    for blob in blobs:
        out.write(blob)
    return _PREFIX.size + len(head) + gap + offset


def read_header(f: BinaryIO) -> tuple[dict, int]:
    """(header, payload start) of an open plan file; PlanFileError if it is not one of ours."""
    prefix = f.read(_PREFIX.size)
    if len(prefix) < _PREFIX.size:
        raise PlanFileError("truncated before the header")
    magic, version, head_len, head_crc, _ = _PREFIX.unpack(prefix)
    if magic != MAGIC:
        raise PlanFileError("not a flexplan plan file (bad magic)")
    if version != FILE_FORMAT_VERSION:
        raise PlanFileError(f"plan file format {version}, this flexplan reads {FILE_FORMAT_VERSION}")
    if head_len > _MAX_HEADER_BYTES:
        raise PlanFileError(f"header length {head_len} is implausible")
    head = f.read(head_len)
    if len(head) < head_len or zlib.crc32(head) != head_crc:
        raise PlanFileError("header truncated or corrupt (crc mismatch)")
    try:
        header = json.loads(head)
    except ValueError as exc:
        raise PlanFileError(f"header is not JSON: {exc}") from None
    if header.get("plan_version") != PLAN_FORMAT_VERSION:
        raise PlanFileError(f"plan version {header.get('plan_version')}, expected {PLAN_FORMAT_VERSION}")
    return header, _aligned(_PREFIX.size + head_len)


def read_plan(path: str | os.PathLike, device: torch.device, expect_key: str | None = None,
              accept: Callable[[dict, int], bool] | None = None) -> tuple[ConvPlan | None, dict]:
    """Load and verify one plan file onto `device`; PlanFileError on any defect.

    accept(header, file_bytes), if given, sees the header first; (None, header) if it declines.
    """
    device = torch.device(device)
    with open(path, "rb") as f:
        header, start = read_header(f)
        if expect_key is not None and header.get("key") != expect_key:
            raise PlanFileError(f"file holds key {header.get('key')}, expected {expect_key}")
        size = int(header.get("payload_bytes", -1))
        file_bytes = os.fstat(f.fileno()).st_size
        if file_bytes != start + size:
            raise PlanFileError(f"file is {file_bytes} bytes, its header says {start + size}")
        if accept is not None and not accept(header, file_bytes):
            return None, header
        # One read into host memory; pinned for accelerators so the copy below is asynchronous.
        buf = torch.empty(size, dtype=torch.uint8, pin_memory=device.type == "cuda")
        f.seek(start)
        if size and f.readinto(buf.numpy()) != size:
            raise PlanFileError("payload truncated")
    if zlib.crc32(buf.numpy()) != header["payload_crc32"]:
        raise PlanFileError("payload corrupt (crc mismatch)")
    tensors = {}
    try:
        for e in header["tensors"]:
            stored, dtype = _DTYPES[e["stored"]], _DTYPES[e["dtype"]]
            lo, hi = e["offset"], e["offset"] + e["nbytes"]
            if not 0 <= lo <= hi <= size:
                raise PlanFileError(f"tensor {e['name']} lies outside the payload")
            t = buf[lo:hi].view(stored).reshape(e["shape"])
            t = t.to(device, non_blocking=True)
            tensors[e["name"]] = t.to(dtype) if stored != dtype else t
        plan = plan_from_parts(header["meta"], tensors)
        problem = plan_problem(plan)
    except (KeyError, TypeError, RuntimeError, ValueError, IndexError) as exc:
        if isinstance(exc, PlanFileError):
            raise
        raise PlanFileError(f"header does not describe a valid plan: {exc!r}") from None
    if problem is not None:
        raise PlanFileError(f"plan contents out of bounds: {problem}")
    return plan, header


def plan_problem(plan: ConvPlan) -> str | None:
    """None if every index of the plan lies where the kernels may read (a checksum says the
    file is what was written, not that what was written is sound), else the first defect.
    Sizes are checked on the host; the values in one launch (kernels_src/plan_check.py) or,
    where kernels cannot run, one reduction per tensor, then one host sync."""
    n_in, n_out, v = plan.num_in, plan.num_out, plan.kernel_volume
    bounds = []  # (name, tensor, low, high): low <= every value < high

    def gather_map(name, gmap, rows, targets):
        if tuple(gmap.neighbor_map.shape) != (rows, v) or tuple(gmap.sorted_idx.shape) != (rows,):
            return f"{name} maps {tuple(gmap.neighbor_map.shape)} rows, expected ({rows}, {v})"
        bounds.append((f"{name}.neighbor_map", gmap.neighbor_map, -1, targets))
        bounds.append((f"{name}.sorted_idx", gmap.sorted_idx, 0, rows))
        for block in gmap.block_sizes:
            seg, kernels = gmap.valid_kernel_seg[block], gmap.valid_kernel[block]
            if seg.numel() != -(-rows // block) + 1:
                return f"{name}.valid_kernel_seg.{block} has {seg.numel()} entries"
            bounds.append((f"{name}.valid_kernel.{block}", kernels, 0, v))
            segs.append((f"{name}.valid_kernel_seg.{block}", seg, kernels.numel()))
        return None

    segs = []  # (name, seg, total): starts at 0, never decreases, ends at total
    for problem in (gather_map("fwd", plan.fwd, n_out, n_in),
                    None if plan.bwd is None else gather_map("bwd", plan.bwd, n_in, n_out)):
        if problem:
            return problem
    if tuple(plan.out_coords.shape) != (n_out, 4):
        return f"out_coords has shape {tuple(plan.out_coords.shape)}, expected ({n_out}, 4)"
    pairs = plan.valid_signal_i.numel()
    if plan.valid_signal_seg.numel() < 1 or plan.signal_offsets not in (
            0, mirrored_signal_offsets(v), v):
        return f"valid_signal_seg has {plan.valid_signal_seg.numel()} entries"
    if plan.valid_signal_o.numel() != pairs:
        return "valid_signal pairs and offsets disagree"
    bounds += [("valid_signal_i", plan.valid_signal_i, 0, n_in),
               ("valid_signal_o", plan.valid_signal_o, 0, n_out)]
    segs.append(("valid_signal_seg", plan.valid_signal_seg, pairs))
    names = [b[0] for b in bounds] + [s_[0] for s_ in segs]
    tensors = [b[1] for b in bounds] + [s_[1] for s_ in segs]
    if _check_kernel_runs_on(tensors):
        ok = _values_ok_kernel(bounds, segs)
    else:
        ok = _values_ok_torch(bounds, segs)
    for name, good in zip(names, ok):
        if not good:
            return f"{name} holds indices outside its range"
    return None


# The load check's launch (kernels_src/plan_check.py): a program per BLOCK * ITERS entries of a
# tensor: long programs, since one atomic per program of 1024 entries was slow on large plans
# (measurements: scripts/results/design_measurements.md).
PLAN_CHECK_LAUNCH = dict(BLOCK=1024, ITERS=8, num_warps=4)


def launch_plan_check(run, table: INT64, flags: INT32, longest: SIZE, rows: SIZE) -> None:
    """flags [rows]: nonzero where a check of the table [rows, TABLE_COLUMNS] fails; longest: the
    most entries one row checks. (The launch written once, for the check below and the AOT
    build: flexplan/launch_spec.py.)"""
    from ..kernels_src import plan_check

    per_program = PLAN_CHECK_LAUNCH["BLOCK"] * PLAN_CHECK_LAUNCH["ITERS"]
    run(plan_check.plan_bounds_kernel, (-(-longest // per_program), rows), table, flags,
        **PLAN_CHECK_LAUNCH)


def _check_kernel_runs_on(tensors: list) -> bool:
    """One launch where kernels run (a GPU, or the interpreter) and every tensor is a contiguous
    int32 array, as plans hold them; else the torch expressions."""
    return (bool(tensors) and kernels_run_on(tensors[0])
            and all(t.dtype == torch.int32 and t.is_contiguous() for t in tensors))


def _values_ok_kernel(bounds, segs) -> list[bool]:
    """Every check in one launch and one host sync (the table's copy to the device is small)."""
    from ..kernels_src import plan_check
    from ..launcher import launch

    rows = [(t.data_ptr(), t.numel(), low, high, plan_check.RANGE) for _, t, low, high in bounds]
    rows += [(seg.data_ptr(), seg.numel(), 0, total, plan_check.SEGMENTS) for _, seg, total in segs]
    device = bounds[0][1].device if bounds else segs[0][1].device
    table = torch.tensor(rows, dtype=torch.int64).to(device)
    flags = torch.zeros(len(rows), dtype=torch.int32, device=device)
    longest = max(row[1] for row in rows)
    with on_device_of(flags):  # the plan's GPU, whatever device is current
        if longest:
            launch_plan_check(launch, table, flags, longest, len(rows))
        return [flag == 0 for flag in flags.tolist()]  # the one host sync


def _values_ok_torch(bounds, segs) -> list[bool]:
    """The kernel's oracle: a reduction per check, one host sync."""
    flags = []
    for _, t, low, high in bounds:
        flags.append(((t >= low) & (t < high)).all() if t.numel() else t.new_ones((), dtype=torch.bool))
    for _, seg, total in segs:
        steps = (seg[1:] >= seg[:-1]).all() if seg.numel() > 1 else seg.new_ones((), dtype=torch.bool)
        flags.append(steps & (seg[0] == 0) & (seg[-1] == total))
    return torch.stack(flags).tolist() if flags else []
