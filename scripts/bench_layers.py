"""Per-layer benchmark (issue #21): every convolution shape of OpenPCDet's VoxelResBackBone8x
encoder (scripts/e2e_networks.py), flexplan vs spconv 2.3, in each precision, on one LiDAR batch.

Which layer makes a training step slow, in which precision: one row per layer shape and dtype.
- Coordinates: one flexplan.workloads.lidar_batch (batch 2, fixed seed) on the Waymo grid
  (sparse_shape 41 x 1504 x 1504). The encoder's levels are made once by flexplan.nn.spconv
  SparseConv3d layers of the encoder's geometry: L1 = the input voxels; L2 = k3 s2 p1 of L1;
  L3 = k3 s2 p1 of L2; L4 = k3 s2 p(0,1,1) of L3; the head (conv_out) is k(3,1,1) s(2,1,1) p0.
- Layers: SubMConv3d 3x3x3 at L1 (4->16, conv_input; 16->16, res1), L2 (32->32), L3 (64->64),
  L4 (128->128); the strided convs 16->32 (L1->L2), 32->64 (L2->L3), 64->128 (L3->L4); the head
  128->128. Biased as OpenPCDet's blocks are: SparseBasicBlock convs have a bias, the
  post_act_block convs (conv_input, the strided convs, the head) none. "uses" is how often the
  shape occurs in the encoder; sum(uses x time) estimates the encoder's convolution time.
- dtypes (--dtypes): fp32 = spconv float32 (spconv.constants.SPCONV_ALLOW_TF32 = False, its
  default) vs flexplan float32 (its default, 3xTF32 on tensor cores); tf32 = spconv with
  SPCONV_ALLOW_TF32 = True vs flexplan allow_tf32=True; fp16 / bf16 = both layers cast.
  torch.backends.cuda.matmul.allow_tf32 follows the row (tf32 rows only).
- Weights: a seeded spconv layer; the flexplan layer loads its state_dict (without spconv:
  a seeded flexplan layer). Inputs: random normal features; fwd+bwd takes the gradient of a
  random output gradient with respect to the features, weight and bias.
- Timing: median ms of --reps calls after --warmup calls, each call between CUDA events with
  the L2 cache flushed before it (as triton.testing.do_bench). fwd: forward under
  torch.no_grad(); fwd+bwd: forward and backward. Both libraries reuse their index pairs:
  flexplan's plans live on the input SparseConvTensor (the same object every call, plan built
  in the warm-up); spconv rebuilds a strided conv's pairs on every call (indice_key reuse is for
  submanifold convs only), so its pair builders (spconv.pytorch.ops.get_indice_pairs[_implicit_
  gemm]) are memoized while this script runs: only convolution kernels are timed on both sides.
  A row whose spconv calls still built pairs says so ("sp incl. pairs").
- Accuracy: forward max|err| / max|ref| against a float64 reference (flexplan's layer in
  float64, algo="explicit", from the same inputs and weights upcast), for both libraries;
  spconv's output rows are matched to the reference by coordinates. Target: flexplan's fp32
  error within 2x of spconv's.

Writes scripts/results/bench_layers.md (--small: only with --out), prints the table.

Usage (GPU): python3 scripts/bench_layers.py [--dtypes fp32,tf32,fp16,bf16] [--reps 50]
                 [--warmup 10] [--layers res1,spconv2,...] [--no-spconv]
CPU smoke:   TRITON_INTERPRET=1 python scripts/bench_layers.py --small --no-spconv
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import inspect
import math
import os
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

SCRIPTS = Path(__file__).resolve().parent
sys.path.insert(0, str(SCRIPTS))
RESULTS = SCRIPTS / "results" / "bench_layers.md"

# name -> (torch dtype, allow_tf32)
DTYPES = {"fp32": (torch.float32, False), "tf32": (torch.float32, True),
          "fp16": (torch.float16, False), "bf16": (torch.bfloat16, False)}


# ---------------------------------------------------------------- layers

@dataclass(frozen=True)
class LayerSpec:
    name: str            # the encoder's module name
    level: int           # input level (1..4)
    ci: int
    co: int
    subm: bool
    bias: bool
    uses: int            # how often this shape occurs in VoxelResBackBone8x
    kernel: tuple = (3, 3, 3)
    stride: tuple = (1, 1, 1)
    padding: tuple = (1, 1, 1)

    def label(self) -> str:
        if self.subm:
            kind = f"subm 3x3x3 @L{self.level}"
        else:
            k = "x".join(map(str, self.kernel))
            s = ",".join(map(str, self.stride)) if len(set(self.stride)) > 1 else str(self.stride[0])
            p = ",".join(map(str, self.padding)) if len(set(self.padding)) > 1 else str(self.padding[0])
            to = f"L{self.level + 1}" if self.level < 4 else "out"
            kind = f"conv {k} s{s} p{p} L{self.level}->{to}"
        return f"{self.name}: {kind} {self.ci}->{self.co}{' +b' if self.bias else ''}"


def encoder_layers(base: int) -> list[LayerSpec]:
    """The encoder's convolution shapes, in network order (OpenPCDet: base 16)."""
    c1, c2, c3, c4 = base, 2 * base, 4 * base, 8 * base
    down = dict(subm=False, bias=False, uses=1, stride=(2, 2, 2))
    return [
        LayerSpec("conv_input", 1, 4, c1, subm=True, bias=False, uses=1),
        LayerSpec("res1", 1, c1, c1, subm=True, bias=True, uses=4),
        LayerSpec("spconv2", 1, c1, c2, padding=(1, 1, 1), **down),
        LayerSpec("res2", 2, c2, c2, subm=True, bias=True, uses=4),
        LayerSpec("spconv3", 2, c2, c3, padding=(1, 1, 1), **down),
        LayerSpec("res3", 3, c3, c3, subm=True, bias=True, uses=4),
        LayerSpec("spconv4", 3, c3, c4, padding=(0, 1, 1), **down),
        LayerSpec("res4", 4, c4, c4, subm=True, bias=True, uses=4),
        LayerSpec("conv_out", 4, c4, c4, subm=False, bias=False, uses=1, kernel=(3, 1, 1),
                  stride=(2, 1, 1), padding=(0, 0, 0)),
    ]


# The strided convs that make levels 2, 3, 4 and the head's output from level 1.
LEVEL_CONVS = [((3, 3, 3), (2, 2, 2), (1, 1, 1)), ((3, 3, 3), (2, 2, 2), (1, 1, 1)),
               ((3, 3, 3), (2, 2, 2), (0, 1, 1)), ((3, 1, 1), (2, 1, 1), (0, 0, 0))]


def make_layer(sp, spec: LayerSpec, **kwargs):
    if spec.subm:
        return sp.SubMConv3d(spec.ci, spec.co, 3, padding=1, bias=spec.bias, **kwargs)
    return sp.SparseConv3d(spec.ci, spec.co, list(spec.kernel), stride=list(spec.stride),
                           padding=list(spec.padding), bias=spec.bias, **kwargs)


# ---------------------------------------------------------------- data

@dataclass
class Level:
    indices: torch.Tensor    # int32 [N, 4] (b, z, y, x)
    spatial_shape: tuple
    fx: object               # flexplan SparseConvTensor over these coords: holds their plans


def build_levels(sp_fx, args, device) -> tuple[dict, int, object]:
    """Level 1 = one lidar_batch; levels 2..4 and the head's output (5) from flexplan strided
    convs of the encoder's geometry. Returns {level: Level}, the batch size and the grid."""
    from flexplan.workloads import SMALL_GRID, WAYMO_GRID, lidar_batch
    from flexplan import tensor_plan

    if args.small:  # ~100 voxels: minutes through the interpreter
        grid, scan = SMALL_GRID, dict(beams=2, azimuth_steps=32, max_range=24.0, num_boxes=8,
                                      num_poles=4)
    else:
        grid, scan = WAYMO_GRID, {}
    batch = lidar_batch(0, args.batch, args.seed, device, grid, **scan)
    x = sp_fx.SparseConvTensor(torch.zeros(batch.indices.shape[0], 1, device=device),
                               batch.indices, list(batch.spatial_shape), batch.batch_size)
    levels = {1: Level(x.indices, tuple(x.spatial_shape), x)}
    with torch.no_grad():
        for level, (k, s, p) in enumerate(LEVEL_CONVS, start=2):
            conv = sp_fx.SparseConv3d(1, 1, list(k), stride=list(s), padding=list(p),
                                      bias=False).to(device)
            out = conv(x)
            indices = out.indices.contiguous()
            x = sp_fx.SparseConvTensor(torch.zeros(indices.shape[0], 1, device=device), indices,
                                       list(out.spatial_shape), batch.batch_size)
            levels[level] = Level(x.indices, tuple(x.spatial_shape), x)
    return levels, batch.batch_size, grid


# ---------------------------------------------------------------- spconv's pairs

def _freeze(value):
    """A hashable stand-in of an argument: tensors by storage, shape and dtype."""
    if isinstance(value, torch.Tensor):
        return ("tensor", value.data_ptr(), tuple(value.shape), str(value.dtype))
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    try:
        hash(value)
        return value
    except TypeError:
        return repr(value)


class SpconvPairMemo:
    """While active, spconv's index-pair builders return the pairs they built for the same
    indices tensor and arguments before: spconv reuses a submanifold conv's pairs through
    indice_key but rebuilds a strided conv's on every call. Hits only when the very same
    indices tensor object comes back (held here, so its memory cannot be reused)."""

    NAMES = ("get_indice_pairs_implicit_gemm", "get_indice_pairs")
    SKIP = ("alloc", "timer")

    def __init__(self):
        import spconv.pytorch.ops as ops

        self.ops, self.originals, self.store = ops, {}, {}
        self.hits = self.misses = 0

    def __enter__(self):
        for name in self.NAMES:
            fn = getattr(self.ops, name, None)
            if fn is not None:
                self.originals[name] = fn
                setattr(self.ops, name, self._wrap(name, fn))
        return self

    def __exit__(self, *exc):
        for name, fn in self.originals.items():
            setattr(self.ops, name, fn)
        self.originals = {}
        return False

    def _wrap(self, name, fn):
        signature = inspect.signature(fn)

        def memoized(*args, **kwargs):
            try:
                bound = signature.bind(*args, **kwargs)
            except TypeError:
                return fn(*args, **kwargs)
            indices = bound.arguments.get("indices")
            key = (name,) + tuple((k, _freeze(v)) for k, v in bound.arguments.items()
                                  if k not in self.SKIP)
            held = self.store.get(key)
            if held is not None and held[0] is indices:
                self.hits += 1
                return held[1]
            self.misses += 1
            result = fn(*args, **kwargs)
            self.store[key] = (indices, result)
            return result

        return memoized


# ---------------------------------------------------------------- timing and accuracy

def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Timer:
    """Median ms of `reps` calls after `warmup` calls. CUDA: events around each call, the L2
    cache flushed before it (a 256 MiB write, as triton.testing.do_bench); CPU: wall clock."""

    def __init__(self, device, warmup: int, reps: int):
        self.device, self.warmup, self.reps = device, warmup, max(reps, 1)
        self.flush = (torch.empty(256 * 2 ** 20, dtype=torch.int8, device=device)
                      if device.type == "cuda" else None)
        self.how = ("CUDA events, L2 flushed before each call" if self.flush is not None
                    else "wall clock, CPU")

    def __call__(self, fn) -> float:
        for _ in range(self.warmup):
            fn()
        sync(self.device)
        if self.flush is None:
            times = []
            for _ in range(self.reps):
                start = time.perf_counter()
                fn()
                times.append((time.perf_counter() - start) * 1e3)
            return statistics.median(times)
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(self.reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(self.reps)]
        for start, end in zip(starts, ends):
            self.flush.zero_()
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize(self.device)
        return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def coord_keys(indices: torch.Tensor, spatial_shape) -> torch.Tensor:
    s0, s1, s2 = spatial_shape
    b, d0, d1, d2 = indices.long().unbind(1)
    return ((b * s0 + d0) * s1 + d1) * s2 + d2


def align_rows(feats: torch.Tensor, indices: torch.Tensor, ref_indices: torch.Tensor,
               spatial_shape) -> torch.Tensor:
    """feats (rows at `indices`) reordered to the rows of ref_indices; the coordinate sets must
    be equal."""
    if indices.shape == ref_indices.shape and torch.equal(indices.to(ref_indices.dtype), ref_indices):
        return feats
    if indices.shape[0] != ref_indices.shape[0]:
        raise ValueError(f"output coords differ: {indices.shape[0]} rows vs {ref_indices.shape[0]}")
    keys, ref_keys = coord_keys(indices, spatial_shape), coord_keys(ref_indices, spatial_shape)
    order, ref_order = torch.argsort(keys), torch.argsort(ref_keys)
    if not torch.equal(keys[order], ref_keys[ref_order]):
        raise ValueError("output coords differ from flexplan's (same count, other sites)")
    out = torch.empty_like(feats)
    out[ref_order] = feats[order]
    return out


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    got, ref = got.detach().double(), ref.detach().double()
    return float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-300))


def short_error(exc: BaseException) -> str:
    lines = f"{exc.__class__.__name__}: {exc}".strip().splitlines()
    return (lines[0] if lines else exc.__class__.__name__)[:200]


def fx_algos(spec: LayerSpec, plan, dtype_name: str) -> str:
    """flexplan's "auto" picks for fwd / dgrad / wgrad of this shape (best effort)."""
    try:
        from flexplan.ops.conv import _resolve_algo

        v = math.prod(spec.kernel)
        return "/".join(_resolve_algo("auto", part, n, spec.ci, spec.co, v, dtype_name) for part, n in
                        (("fwd", plan.num_out), ("dgrad", plan.num_in), ("wgrad", plan.num_pairs)))
    except Exception:  # a private helper: its signature may change
        return "?"


@contextlib.contextmanager
def precision(tf32: bool, spconv_module):
    """torch's matmul TF32 flag and spconv's SPCONV_ALLOW_TF32 for one row, restored after."""
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = tf32
    sp_previous = None
    if spconv_module is not None:
        sp_previous = spconv_module.constants.SPCONV_ALLOW_TF32
        spconv_module.constants.SPCONV_ALLOW_TF32 = tf32
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous
        if spconv_module is not None:
            spconv_module.constants.SPCONV_ALLOW_TF32 = sp_previous


# ---------------------------------------------------------------- one row

@dataclass
class Context:
    args: argparse.Namespace
    device: torch.device
    levels: dict
    batch_size: int
    sp_fx: object
    sp_ref: object | None       # spconv.pytorch, or None
    spconv: object | None       # the spconv package (constants)
    memo: SpconvPairMemo | None
    timer: Timer


def run_row(ctx: Context, spec: LayerSpec, index: int, dtype_name: str, state: dict) -> dict:
    """Times and checks one layer shape in one dtype; failures are the row's notes."""
    dtype, tf32 = DTYPES[dtype_name]
    device, level = ctx.device, ctx.levels[spec.level]
    row = dict(layer=spec.label(), name=spec.name, uses=spec.uses, dtype=dtype_name,
               n_in=int(level.indices.shape[0]), notes=[])

    def attempt(what, fn):
        try:
            return fn()
        except Exception as exc:  # the row's cell, never the run's end
            if ctx.args.verbose:
                traceback.print_exc(limit=6)
            row["notes"].append(f"{what}: {short_error(exc)}")
            if isinstance(exc, torch.OutOfMemoryError):
                torch.cuda.empty_cache()
            with contextlib.suppress(Exception):
                sync(device)
            return None

    gen = torch.Generator(device=device).manual_seed(ctx.args.seed * 1000 + index)
    feats = torch.randn(row["n_in"], spec.ci, device=device, generator=gen).to(dtype)

    # flexplan: the level's tensor with these features (its plans shared with the level).
    fx = make_layer(ctx.sp_fx, spec, allow_tf32=tf32).to(device)
    fx.load_state_dict(state)
    fx.to(dtype)
    fx_in = level.fx.replace_feature(feats)
    fx_feats_g = feats.clone().requires_grad_()
    fx_in_g = level.fx.replace_feature(fx_feats_g)
    plan = tensor_plan(fx_in, fx.geometry, training=True)
    row["n_out"], row["pairs"] = int(plan.num_out), int(plan.num_pairs)
    row["fx_algos"] = fx_algos(spec, plan, "tf32" if tf32 else str(dtype).removeprefix("torch."))
    grad = torch.randn(row["n_out"], spec.co, device=device, generator=gen).to(dtype)

    with precision(tf32, ctx.spconv):
        # float64 reference from the same (cast) inputs and weights.
        def reference():
            ref_layer = make_layer(ctx.sp_fx, spec, algo="explicit").to(device).double()
            ref_layer.load_state_dict({k: v.double() for k, v in fx.state_dict().items()})
            with torch.no_grad():
                return ref_layer(level.fx.replace_feature(feats.double())).features

        ref = attempt("reference", reference)

        def fx_fwd():
            with torch.no_grad():
                return fx(fx_in)

        def fx_fwdbwd():
            fx.zero_grad(set_to_none=True)
            fx_feats_g.grad = None
            fx(fx_in_g).features.backward(grad)

        out = attempt("flexplan", fx_fwd)
        if out is not None:
            if ref is not None:
                row["fx_err"] = rel_err(out.features, ref)
            del out
            row["fx_fwd"] = attempt("flexplan fwd", lambda: ctx.timer(fx_fwd))
            row["fx_fwdbwd"] = attempt("flexplan fwd+bwd", lambda: ctx.timer(fx_fwdbwd))

        if ctx.sp_ref is not None:
            attempt("spconv", lambda: spconv_side(ctx, spec, level, state, feats, grad, dtype,
                                                  plan, ref, row))
    for key in [k for k, v in row.items() if v is None]:
        del row[key]
    return row


def spconv_side(ctx: Context, spec, level: Level, state, feats, grad, dtype, plan, ref, row):
    sp = ctx.sp_ref
    layer = make_layer(sp, spec).to(ctx.device)
    layer.load_state_dict(state)
    layer.to(dtype)
    sp_in = sp.SparseConvTensor(feats, level.indices, list(level.spatial_shape), ctx.batch_size)
    feats_g = feats.clone().requires_grad_()
    sp_in_g = sp.SparseConvTensor(feats_g, level.indices, list(level.spatial_shape),
                                  ctx.batch_size)

    def fwd():
        with torch.no_grad():
            return layer(sp_in)

    def fwdbwd():
        layer.zero_grad(set_to_none=True)
        feats_g.grad = None
        layer(sp_in_g).features.backward(grad)

    out = fwd()
    if ref is not None:
        try:
            got = align_rows(out.features, out.indices, plan.out_coords, plan.out_spatial_shape)
            row["sp_err"] = rel_err(got, ref)
        except ValueError as exc:
            row["notes"].append(f"spconv: {exc}")
    if out.features.shape[0] != row["n_out"]:
        row["notes"].append(f"spconv has {out.features.shape[0]} output rows")
    del out
    misses, hits = ctx.memo.misses, ctx.memo.hits  # the pairs were built by the call above
    row["sp_fwd"] = ctx.timer(fwd)
    try:
        row["sp_fwdbwd"] = ctx.timer(fwdbwd)
    except Exception as exc:  # keep the forward's numbers
        row["notes"].append(f"spconv fwd+bwd: {short_error(exc)}")
        if isinstance(exc, torch.OutOfMemoryError):
            torch.cuda.empty_cache()
    if ctx.memo.misses > misses or ctx.memo.hits == hits:  # built again, or not seen at all
        row["notes"].append("sp incl. pairs")


# ---------------------------------------------------------------- report

def fmt(row, key, spec=".3f") -> str:
    value = row.get(key)
    return "-" if value is None else format(value, spec)


def ratio(row, a, b) -> float | None:
    if row.get(a) is None or row.get(b) is None or row[b] <= 0:
        return None
    return row[a] / row[b]


TABLE_HEAD = [
    "| layer | uses | N in -> out | pairs | dtype | spconv fwd | flexplan fwd | x fwd | "
    "spconv fwd+bwd | flexplan fwd+bwd | x fwd+bwd | spconv err | flexplan err | "
    "flexplan algo fwd/dgrad/wgrad | notes |",
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]


def table_line(row: dict) -> str:
    x_fwd, x_fb = ratio(row, "sp_fwd", "fx_fwd"), ratio(row, "sp_fwdbwd", "fx_fwdbwd")
    x = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    notes = "; ".join(row.get("notes", [])).replace("|", "/")
    return (f"| {row['layer']} | {row['uses']} | {row['n_in']} -> {row.get('n_out', '-')} | "
            f"{row.get('pairs', '-')} | {row['dtype']} | {fmt(row, 'sp_fwd')} | "
            f"{fmt(row, 'fx_fwd')} | {x(x_fwd)} | {fmt(row, 'sp_fwdbwd')} | "
            f"{fmt(row, 'fx_fwdbwd')} | {x(x_fb)} | {fmt(row, 'sp_err', '.1e')} | "
            f"{fmt(row, 'fx_err', '.1e')} | {row.get('fx_algos', '-')} | {notes} |")


def geomean(values):
    values = [v for v in values if v is not None and v > 0]
    return math.exp(sum(map(math.log, values)) / len(values)) if values else None


def summary_lines(rows: list[dict], dtypes: list[str]) -> list[str]:
    lines = []
    for dtype_name in dtypes:
        group = [r for r in rows if r["dtype"] == dtype_name]
        if not group:
            continue
        parts = []
        for mode, label in (("fwd", "fwd"), ("fwdbwd", "fwd+bwd")):
            fx = [r.get(f"fx_{mode}") for r in group]
            sp = [r.get(f"sp_{mode}") for r in group]
            text = f"{label}: flexplan "
            text += (f"{sum(r['uses'] * t for r, t in zip(group, fx)):.2f} ms"
                     if all(t is not None for t in fx) else "incomplete")
            if any(t is not None for t in sp):
                text += ", spconv " + (f"{sum(r['uses'] * t for r, t in zip(group, sp)):.2f} ms"
                                       if all(t is not None for t in sp) else "incomplete")
                gm = geomean(ratio(r, f"sp_{mode}", f"fx_{mode}") for r in group)
                if gm is not None:
                    text += f" (geomean per-layer x {gm:.2f})"
            parts.append(text)
        line = f"- {dtype_name}: encoder convs (sum of uses x time): " + "; ".join(parts)
        slow = [(ratio(r, "sp_fwdbwd", "fx_fwdbwd"), r["name"]) for r in group]
        slow = sorted((v, n) for v, n in slow if v is not None)
        if slow:
            line += f". Slowest vs spconv (fwd+bwd): {slow[0][1]} x{slow[0][0]:.2f}"
        lines.append(line + ".")
    for dtype_name in ("fp32", "tf32"):
        group = [r for r in rows if r["dtype"] == dtype_name and "fx_err" in r and "sp_err" in r]
        if not group:
            continue
        over = [f"{r['name']} ({r['fx_err'] / max(r['sp_err'], 1e-300):.1f}x)" for r in group
                if r["fx_err"] > 2 * r["sp_err"]]
        worst = max(r["fx_err"] / max(r["sp_err"], 1e-300) for r in group)
        lines.append(f"- {dtype_name} accuracy: flexplan error within 2x of spconv's in "
                     f"{len(group) - len(over)}/{len(group)} layers (largest ratio {worst:.2f})"
                     + (f"; over 2x: {', '.join(over)}" if over else "") + ".")
    errors = [f"- {r['name']} {r['dtype']}: {n}" for r in rows for n in r.get("notes", [])
              if n != "sp incl. pairs"]
    if errors:
        lines += ["", "Errors:"] + errors
    return lines


def header_lines(ctx: Context, versions: dict, grid) -> list[str]:
    args, levels = ctx.args, ctx.levels
    sizes = ", ".join(f"L{k} {v.indices.shape[0]} {list(v.spatial_shape)}" if k < 5 else
                      f"head out {v.indices.shape[0]} {list(v.spatial_shape)}"
                      for k, v in levels.items())
    return [
        f"# bench_layers: VoxelResBackBone8x layer shapes, flexplan vs spconv ({versions['date']})",
        "",
        f"{versions['gpu']}; torch {versions['torch']}, Triton {versions['triton']}, spconv "
        f"{versions['spconv']}; flexplan {versions['flexplan']}.",
        f"Data: lidar_batch(step 0, batch {args.batch}, seed {args.seed}) on {grid.voxel_size} m "
        f"voxels; voxels (grid) per level: {sizes}. Base width {args.base}.",
        f"Times: median ms of {ctx.timer.reps} calls after {ctx.timer.warmup} warm-up calls "
        f"({ctx.timer.how}); fwd under torch.no_grad(), fwd+bwd = "
        "forward + backward to features, weight and bias. x = spconv ms / flexplan ms (> 1: "
        "flexplan faster). Index pairs built once on both sides (spconv's pair builders memoized; "
        "'sp incl. pairs' marks a row where they were not).",
        "fp32: spconv float32 (SPCONV_ALLOW_TF32 False) vs flexplan float32 (default 3xTF32); "
        "tf32: SPCONV_ALLOW_TF32 True vs flexplan allow_tf32=True. err: forward max|err| / "
        "max|ref| vs float64 (flexplan explicit in float64 on the same inputs, cast weights). "
        "uses: times the shape occurs in the encoder.",
        "",
    ]


def write(lines: list[str], out: str | None) -> None:
    if not out:
        return
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    out_dir = os.environ.get("OUT")
    if out_dir:
        with contextlib.suppress(OSError):
            Path(out_dir, path.name).write_bytes(path.read_bytes())


def versions_of(device, sp_version: str) -> dict:
    import triton

    from bench_common import today

    try:
        from importlib.metadata import version
        flexplan_version = version("flexplan")
    except Exception:
        flexplan_version = "?"
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=SCRIPTS, text=True,
                                capture_output=True, timeout=10).stdout.strip() or "?"
    except Exception:
        commit = "?"
    gpu = (f"GPU: {torch.cuda.get_device_name(device)}" if device.type == "cuda" else
           f"no GPU (CPU{', Triton interpreter' if os.environ.get('TRITON_INTERPRET') == '1' else ''})")
    return dict(gpu=gpu, torch=torch.__version__, triton=triton.__version__, spconv=sp_version,
                flexplan=f"{flexplan_version} ({commit})", date=today())


# ---------------------------------------------------------------- main

def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", default="fp32,tf32,fp16,bf16",
                        help=f"comma list of {', '.join(DTYPES)}")
    parser.add_argument("--reps", type=int, default=None, help="timed calls (50; --small: 2)")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up calls (10; --small: 1)")
    parser.add_argument("--layers", default=None,
                        help="comma list of layer names (conv_input, res1, spconv2, res2, "
                             "spconv3, res3, spconv4, res4, conv_out); default all")
    parser.add_argument("--batch", type=int, default=2, help="scans per batch")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-spconv", action="store_true", help="flexplan only")
    parser.add_argument("--small", action="store_true",
                        help="a small grid and narrow channels (CPU smoke under TRITON_INTERPRET=1)")
    parser.add_argument("--out", default=None,
                        help="results file (default scripts/results/bench_layers.md; --small: none)")
    parser.add_argument("--verbose", action="store_true", help="tracebacks of row failures")
    args = parser.parse_args(argv)
    args.reps = args.reps if args.reps is not None else (2 if args.small else 50)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.small else 10)
    args.dtypes = [d for d in args.dtypes.split(",") if d]
    bad = [d for d in args.dtypes if d not in DTYPES]
    if bad:
        parser.error(f"--dtypes: unknown {bad}; choose from {list(DTYPES)}")
    args.base = 4 if args.small else 16
    names = [s.name for s in encoder_layers(args.base)]
    args.layers = names if args.layers is None else [n for n in args.layers.split(",") if n]
    bad = [n for n in args.layers if n not in names]
    if bad:
        parser.error(f"--layers: unknown {bad}; choose from {names}")
    if args.out is None and not args.small:
        args.out = str(RESULTS)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        print("no GPU: run under TRITON_INTERPRET=1 (with --small), or on a GPU")
        return 1
    import flexplan.nn.spconv as sp_fx

    sp_ref = spconv = None
    sp_version = "not run"
    if not args.no_spconv:
        import spconv
        import spconv.constants  # noqa: F401 (SPCONV_ALLOW_TF32, read at each call)
        import spconv.pytorch as sp_ref

        sp_version = getattr(spconv, "__version__", "?")
    start = time.time()
    levels, batch_size, grid = build_levels(sp_fx, args, device)
    memo = SpconvPairMemo() if sp_ref is not None else None
    ctx = Context(args, device, levels, batch_size, sp_fx, sp_ref, spconv, memo,
                  Timer(device, args.warmup, args.reps))
    head = header_lines(ctx, versions_of(device, sp_version), grid)
    print("\n".join(head[2:5]), flush=True)
    rows: list[dict] = []
    specs = [s for s in encoder_layers(args.base) if s.name in args.layers]
    with memo if memo is not None else contextlib.nullcontext():
        for index, spec in enumerate(specs):
            # One set of weights per layer shape, every dtype: spconv's, loaded into flexplan.
            torch.manual_seed(args.seed * 1000 + index)
            try:
                master = make_layer(sp_ref if sp_ref is not None else sp_fx, spec)
                state = {k: v.detach().clone().to(device) for k, v in master.state_dict().items()}
            except Exception as exc:
                rows.append(dict(layer=spec.label(), name=spec.name, uses=spec.uses, dtype="-",
                                 n_in=int(levels[spec.level].indices.shape[0]),
                                 notes=[f"layer: {short_error(exc)}"]))
                continue
            for dtype_name in args.dtypes:
                try:
                    row = run_row(ctx, spec, index, dtype_name, copy.copy(state))
                except Exception as exc:  # setup failed (e.g. out of memory): the row says so
                    if args.verbose:
                        traceback.print_exc(limit=6)
                    row = dict(layer=spec.label(), name=spec.name, uses=spec.uses,
                               dtype=dtype_name, n_in=int(levels[spec.level].indices.shape[0]),
                               notes=[short_error(exc)])
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                rows.append(row)
                print(table_line(row), flush=True)
                write(head + TABLE_HEAD + [table_line(r) for r in rows], args.out)  # partial
    lines = head + TABLE_HEAD + [table_line(r) for r in rows] + [""] + summary_lines(rows, args.dtypes)
    lines.append(f"\nTotal {time.time() - start:.0f} s.")
    write(lines, args.out)
    if memo is not None and args.verbose:
        print(f"spconv pair builds: {memo.misses}, reuses: {memo.hits}")
    print()
    print("\n".join(lines))
    if args.out:
        print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
