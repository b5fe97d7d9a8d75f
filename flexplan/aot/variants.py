"""The runtime-dispatchable kernel variants: kernel x dtype x config x specialization.

A Variant is one example call (argument kinds + constexprs + launch options) of one kernel; the
AOT build turns it into Triton's compile inputs with the JIT's own binder, so each variant is
exactly the specialization the JIT would compile for calls like it. Its ints are examples of
their class (make_variant), so the registry lists each specialization once; sizes, counts and
places are not specialized (each kernel's decorator says which), so one variant serves them all.

What is covered is defined once, in flexplan/tuning/aot.py: the layer shapes (widths,
geometries, dtypes, rows) and, for the convs, the launches dispatch makes for them on each
target (conv_launches: "auto"'s algorithm, the target's tuned table else the heuristic, on the
target's shared memory). This module only turns those into launches' arguments, which mirror
the launches in flexplan/ops/sparse_conv.py, flexplan/planner/ (hashmap, segments_triton,
generative_triton) and flexplan/plan.py (the gather maps' views); tests/test_aot.py records the
real ops' launches and checks the registry reproduces them, tests/test_aot_lean.py checks the
conv variants against what dispatch returns.
"""
from __future__ import annotations

import functools
import importlib
import itertools
from dataclasses import dataclass
from typing import Iterable, Iterator

from ..kernel_configs import GATHER_GEMM, PLAN_BLOCK_SIZES, WGRAD
from ..launcher import NOT_SPECIALIZED, SPECIALIZED, arg_specialization
from ..plan import mirrored_signal_offsets
from ..tuning.aot import (AOT_DTYPES, AOT_GEOMETRIES, STRIDED_VOLUMES, SUBMANIFOLD_VOLUMES,
                          ConvLaunch, conv_launches)
from .keys import TARGET_SHARED_MEMORY, TARGETS

# Example values of the ints no kernel specializes on (rows, grid extents, counts): any serve.
EXAMPLE_ROWS = 256
REP_GRID = (128, 128, 128)
# The explicit algorithm's gathers (im2col): picked by "auto" only for 16-bit layers of 768+
# channels (kernel_configs.EXPLICIT_MIN_CHANNELS), or asked for by name; 3x3x3 only.
EXPLICIT_VOLUMES = (27,)
# Pool windows of the sparse U-Nets and detectors that pool: 2x2x2 and 3x3x3.
REP_POOL_VOLUMES = (8, 27)
# The example of each int32 class Triton compiles for (make_variant): 1, divisible by 16, other
# (also every int a kernel does not specialize on: sizes, counts, places).
INT_ONE, INT_DIV16, INT_PLAIN = 1, 16, 17

KERNEL_PACKAGE = "flexplan.kernels_src"
LAUNCH_OPTIONS = {"num_warps", "num_stages", "num_ctas", "maxnreg"}
HASH_INSERT, HASH_SUBM_NMAP = "hash_insert", "submanifold_neighbor_map"
SEGMENT_KERNELS = ("gray_rank", "schedule_offsets", "pairs")
PLAN_HASH = "plan_hash"
GENERATIVE_KERNELS = ("generative_candidates", "run_starts", "generative_scatter", "transpose_map")
VIEW_KERNELS = ("sorted_map_t", "chunk_order")
PLAN_CHECK = "plan_bounds"
IM2COL, IM2COL_CHANNEL_MAJOR = "im2col", "im2col_channel_major"
POOL_FWD, POOL_BWD = "sparse_pool_fwd", "sparse_pool_bwd"
# Kernels: short name -> "module:attribute" in KERNEL_PACKAGE.
KERNELS = {
    GATHER_GEMM: "conv_gather_gemm:conv_gather_gemm_kernel",
    WGRAD: "conv_wgrad:conv_wgrad_kernel",
    HASH_INSERT: "hashmap:hash_insert_kernel",
    HASH_SUBM_NMAP: "hashmap:submanifold_neighbor_map_kernel",
    **{name: f"plan_segments:{name}_kernel" for name in SEGMENT_KERNELS},
    PLAN_HASH: "plan_hash:plan_hash_kernel",
    **{name: f"plan_generative:{name}_kernel" for name in GENERATIVE_KERNELS},
    **{name: f"plan_views:{name}_kernel" for name in VIEW_KERNELS},
    PLAN_CHECK: "plan_check:plan_bounds_kernel",
    IM2COL: "conv_im2col:im2col_kernel",
    IM2COL_CHANNEL_MAJOR: "conv_im2col:im2col_channel_major_kernel",
    POOL_FWD: "sparse_pool:sparse_pool_fwd_kernel",
    POOL_BWD: "sparse_pool:sparse_pool_bwd_kernel",
}


@dataclass(frozen=True)
class Variant:
    """One example call. args: ("tensor", torch dtype name) or ("int", example of the value's
    class) per positional argument; constexprs: sorted (name, value) pairs incl. num_warps /
    num_stages."""

    kernel: str
    args: tuple
    constexprs: tuple

    @property
    def module(self) -> str:
        return f"{KERNEL_PACKAGE}.{KERNELS[self.kernel].split(':')[0]}"

    @property
    def attr(self) -> str:
        return KERNELS[self.kernel].split(":")[1]


def make_variant(kernel: str, values: dict, constexprs: dict) -> Variant:
    """A Variant from {parameter name: ("tensor", dtype) | int} in any order; a parameter the
    registry does not know (the kernel changed) is a clear error, not a silent mismatch. Each
    int becomes the example of its class (_int_example), so calls of one specialization are one
    variant."""
    probe = Variant(kernel, (), ())
    fn = getattr(importlib.import_module(probe.module), probe.attr)
    unknown = set(constexprs) - set(fn.arg_names) - LAUNCH_OPTIONS
    if unknown:
        raise KeyError(f"flexplan/aot/variants.py passes {sorted(unknown)} to {probe.attr}, which has no "
                       "such parameters; update its argument list")
    args = []
    for name, how in zip(fn.arg_names, arg_specialization(fn)):
        if name in constexprs:
            continue
        if name not in values:
            raise KeyError(f"flexplan/aot/variants.py does not describe parameter {name!r} of "
                           f"{probe.attr}; update its argument list")
        value = values[name]
        args.append(value if isinstance(value, tuple) else ("int", _int_example(value, how)))
    return Variant(kernel, tuple(args), tuple(sorted(constexprs.items())))


def _int_example(value: int, how: int) -> int:
    """The example of value's class for a parameter specialized as `how` (launcher's codes):
    what Triton's binder makes of value and of the example is the same."""
    if not -2**31 <= value < 2**31:  # (i64 / u64: as is)
        return value
    if how == NOT_SPECIALIZED:
        return INT_PLAIN
    if value == 1:
        return INT_ONE
    return INT_DIV16 if how == SPECIALIZED and value % 16 == 0 else INT_PLAIN


def _torch_dtype(dtype: str) -> str:
    return "float32" if dtype == "tf32" else dtype


def _acc_dtype(dtype: str) -> str:
    return "float64" if dtype == "float64" else "float32"


def gather_gemm_variants(launch: ConvLaunch, hip: bool) -> Iterator[Variant]:
    """The launches of ops.sparse_conv.gather_gemm for one dispatched launch: grad-input over the
    forward map reversed (submanifold plans) or the backward map (the others); the forward with
    and without bias (split-K adds it after the kernel)."""
    from ..ops.sparse_conv import gather_gemm_constexprs

    problem, cfg = launch.problem, launch.config
    feat, i32 = ("tensor", _torch_dtype(launch.dtype)), ("tensor", "int32")
    out = ("tensor", _acc_dtype(launch.dtype)) if cfg.splitk > 1 else feat
    m, k, n = problem.gemm_mkn
    values = dict(src_ptr=feat, weight_ptr=feat, bias_ptr=feat, map_ptr=i32, order_ptr=i32,
                  chunk_order_ptr=i32, valid_kernel_ptr=i32, valid_kernel_seg_ptr=i32, out_ptr=out,
                  M=m, K=k, N=n, V=problem.v)
    reverses = (True,) * (problem.v in SUBMANIFOLD_VOLUMES) + (False,) * (
        problem.v in STRIDED_VOLUMES) if problem.part == "dgrad" else ()
    biases = (True, False) if problem.part == "fwd" and cfg.splitk == 1 else (False,)
    masked = problem.algo.startswith("masked")
    for reverse, bias in itertools.product(reverses or (False,), biases):
        yield make_variant(GATHER_GEMM, values, gather_gemm_constexprs(
            cfg, masked, reverse, bias, launch.dtype, hip))


def wgrad_variants(launch: ConvLaunch, hip: bool) -> Iterator[Variant]:
    """The launch of ops.sparse_conv.wgrad for one dispatched launch (its config already the
    dtype's: kernel_configs.precision_config)."""
    from ..ops.sparse_conv import wgrad_constexprs

    problem, cfg = launch.problem, launch.config
    feat, i32 = ("tensor", _torch_dtype(launch.dtype)), ("tensor", "int32")
    out = ("tensor", _acc_dtype(launch.dtype)) if cfg.splitk > 1 else feat
    signals = ((mirrored_signal_offsets(problem.v),) * (problem.v in SUBMANIFOLD_VOLUMES)
               + (problem.v,) * (problem.v in STRIDED_VOLUMES))
    for signal in signals or (problem.v,):
        values = dict(grad_out_ptr=feat, src_ptr=feat, pair_out_ptr=i32, pair_in_ptr=i32,
                      pair_seg_ptr=i32, out_ptr=out, CO=problem.co, CI=problem.ci, V=problem.v,
                      S=signal)
        yield make_variant(WGRAD, values, wgrad_constexprs(cfg, launch.dtype, hip))


def _submanifold():
    return [g for g in AOT_GEOMETRIES if g.submanifold]


def _strided():
    return [g for g in AOT_GEOMETRIES if not g.submanifold]


def planner_variants() -> Iterator[Variant]:
    """The launches of flexplan.planner.hashmap: table build and submanifold neighbour map, for
    the submanifold geometries of AOT_GEOMETRIES."""
    from ..planner.hashmap import INSERT_LAUNCH, LOOKUP_LAUNCH

    i32, i64 = ("tensor", "int32"), ("tensor", "int64")
    for key_64 in (False, True):
        common = dict(table_keys=i64, table_vals=i32, coords=i32, nmap=i32, n=EXAMPLE_ROWS,
                      slot_mask=(1 << 12) - 1, batch_size=2, size_x=REP_GRID[0], size_y=REP_GRID[1],
                      size_z=REP_GRID[2])
        for volume in sorted({1} | {g.volume for g in _submanifold()}):  # 1: coords_problems
            yield make_variant(HASH_INSERT, dict(common, problems=i64),
                               dict(V=volume, KEY_64=key_64, **INSERT_LAUNCH))
        for g in _submanifold():
            (kx, ky, kz), (dx, dy, dz) = g.kernel_size, g.dilation
            yield make_variant(HASH_SUBM_NMAP, common, dict(
                KX=kx, KY=ky, KZ=kz, DX=dx, DY=dy, DZ=dz, KEY_64=key_64, **LOOKUP_LAUNCH))


def segment_variants() -> Iterator[Variant]:
    """The launches of flexplan.planner.segments_triton (Gray-code order, per-block offsets,
    grad-weight pairs) and of the plan cache's coordinate hash (flexplan.coords_hash), for the
    volumes of AOT_GEOMETRIES."""
    from ..coords_hash import _TRITON_BLOCK
    from ..planner import segments_triton as seg
    from ..planner.segments import rank_words

    i32, i64 = ("tensor", "int32"), ("tensor", "int64")
    smallest, levels = seg.block_levels(PLAN_BLOCK_SIZES)
    m = EXAMPLE_ROWS  # (no size is specialized: one row count serves all)
    for v in sorted({g.volume for g in AOT_GEOMETRIES}):
        bits, dtype, words = rank_words(v)
        word = ("tensor", str(dtype).removeprefix("torch."))
        n_blocks = sum(-(-m // (smallest << l)) for l in range(levels))
        words_constexprs = dict(WORDS=words, WORD_BITS=bits)
        level_constexprs = dict(words_constexprs, B0=smallest, LEVELS=levels)
        yield make_variant("gray_rank", dict(nmap=i32, ranks=word, counts=i32, n=m,
                                             signal_offsets=v, padded=m),
                           dict(words_constexprs, V=v, **seg.GRAY_RANK_LAUNCH))
        # build_plan (two flags: the coords check) and the schedule alone; scans of int32 and int64
        for num_flags, scan in itertools.product((0, 2), (i32, i64)):
            yield make_variant("schedule_offsets", dict(
                sorted_ranks=word, order=i64, sorted_idx=i32, counts=i32, scan=scan,
                plan_out=i32, readback=i64, n=m, entries=m, kernels_at=m, segs_at=m + n_blocks * v,
                chunks=1, tiles=2), dict(level_constexprs, V=v, FLAGS=num_flags, **seg.SCHEDULE_LAUNCH))
        # submanifold plans keep the mirrored half of the offsets, the others all of them
        offsets = ((mirrored_signal_offsets(v),) * (v in SUBMANIFOLD_VOLUMES)
                   + (v,) * (v in STRIDED_VOLUMES))
        for signal, scan in itertools.product(offsets, (i32, i64)):
            yield make_variant("pairs", dict(nmap=i32, scan=scan, pair_rows=i32, room=m, seg=i32,
                                             n=m),
                               dict(V=v, SIGNAL=signal, **seg.PAIRS_LAUNCH,
                                    V_CHUNK=seg.pairs_v_chunk(signal)))
    yield make_variant(PLAN_HASH, dict(words_ptr=i64, partial_ptr=i64, n_words=m), dict(BLOCK=_TRITON_BLOCK))


def generative_variants() -> Iterator[Variant]:
    """The launches of flexplan.planner.generative_triton (strided and transposed plans; their
    schedules: segment_variants), for the strided and transposed geometries of AOT_GEOMETRIES
    and both key dtypes."""
    import torch

    from ..planner import generative_triton as gen

    i32, i64 = ("tensor", "int32"), ("tensor", "int64")
    n = EXAMPLE_ROWS
    grid = dict(size_x=REP_GRID[0], size_y=REP_GRID[1], size_z=REP_GRID[2])
    for geometry, key_dtype in itertools.product(_strided(), (torch.int32, torch.int64)):
        keys = ("tensor", str(key_dtype).removeprefix("torch."))
        sent, slots = gen.SENTINEL[key_dtype], gen.candidate_slots(geometry)
        per_axis = {f"{name}{axis}": value for name, values in (
            ("K", geometry.kernel_size), ("S", geometry.stride), ("P", geometry.padding),
            ("D", geometry.dilation)) for axis, value in zip("XYZ", values)}
        yield make_variant("generative_candidates", dict(coords=i32, keys=keys, taps=i32, n=n, **grid),
                           dict(per_axis, T=slots, TRANSPOSED=geometry.transposed, SENT=sent,
                                **gen.CANDIDATES_LAUNCH))
        yield make_variant("run_starts", dict(sorted_keys=keys, starts=i32, totals=i64, total=n * slots),
                           dict(SENT=sent, **gen.ENTRIES_LAUNCH))
        for write_fwd in (False, True):  # the bwd map, then the fwd map and output coords
            yield make_variant("generative_scatter", dict(
                sorted_keys=keys, order=i64, rank=i32, taps=i32, bwd=i32, fwd=i32, out_coords=i32,
                total=n * slots, n_in=n, **grid), dict(T=slots, V=geometry.volume, SENT=sent,
                                                      WRITE_BWD=not write_fwd, WRITE_FWD=write_fwd,
                                                      **gen.ENTRIES_LAUNCH))
    for volume in sorted(STRIDED_VOLUMES):  # an inverse conv's bwd map
        yield make_variant("transpose_map", dict(fwd=i32, bwd=i32, entries=n * volume),
                           dict(V=volume, **gen.TRANSPOSE_LAUNCH))


def view_variants() -> Iterator[Variant]:
    """The launches of GatherMap.sorted_map_t and GatherMap.chunk_order (flexplan/plan.py): one
    specialization each (rows, volume and the places of sorted_idx are not specialized)."""
    from ..kernel_configs import SCHEDULE_CHUNK
    from ..plan import CHUNK_ORDER_LAUNCH, SORTED_MAP_T_LAUNCH

    i32, m = ("tensor", "int32"), EXAMPLE_ROWS
    yield make_variant("sorted_map_t", dict(nmap=i32, sorted_idx=i32, out=i32, m=m, V=27),
                       SORTED_MAP_T_LAUNCH)
    yield make_variant("chunk_order", dict(sorted_idx=i32, order=i32, m=m),
                       dict(CHUNK=SCHEDULE_CHUNK, **CHUNK_ORDER_LAUNCH))


def check_variants() -> Iterator[Variant]:
    """The plan-file load check (flexplan/cache/format.py, plan_problem): one specialization."""
    from ..cache.format import PLAN_CHECK_LAUNCH

    yield make_variant(PLAN_CHECK, dict(table=("tensor", "int64"), flags=("tensor", "int32")),
                       PLAN_CHECK_LAUNCH)


def _feature_dtypes() -> list[str]:
    """The torch dtypes of the covered dtypes (tf32 is float32)."""
    return sorted({_torch_dtype(d) for d in AOT_DTYPES})


def im2col_variants() -> Iterator[Variant]:
    """The launches of ops.sparse_conv._im2col_chunks (the explicit algorithm's gathers), for
    every feature dtype; their tiles are fixed, so rows and channels only vary the int classes."""
    from ..kernel_configs import IM2COL_BLOCK_K, IM2COL_BLOCK_M, im2col_channel_major_blocks

    i32 = ("tensor", "int32")
    for dtype, v in itertools.product(_feature_dtypes(), EXPLICIT_VOLUMES):
        values = dict(src_ptr=("tensor", dtype), map_ptr=i32, out_ptr=("tensor", dtype), row_start=0,
                      rows=EXAMPLE_ROWS, K=1024, V=v)
        yield make_variant(IM2COL, values, dict(BLOCK_M=IM2COL_BLOCK_M, BLOCK_K=IM2COL_BLOCK_K))
        block_m, block_k, v_pad = im2col_channel_major_blocks(v)
        for reverse in (False, True):  # grad-input of strided plans, of submanifold ones
            yield make_variant(IM2COL_CHANNEL_MAJOR, values, dict(
                REVERSE_V=reverse, BLOCK_M=block_m, BLOCK_K=block_k, V_PAD=v_pad))


def pool_variants() -> Iterator[Variant]:
    """The launches of ops.sparse_pool (max / avg, forward with and without what the backward
    reads, backward) for the covered feature dtypes, channel counts divisible by 16 (others
    JIT-compile) and REP_POOL_VOLUMES."""
    import torch

    from ..ops.sparse_pool import pool_backward_constexprs, pool_forward_constexprs

    i32, f32 = ("tensor", "int32"), ("tensor", "float32")
    for dtype, mode, volume in itertools.product(_feature_dtypes(), ("max", "avg"), REP_POOL_VOLUMES):
        feats, torch_dtype = ("tensor", dtype), getattr(torch, dtype)
        # inference, training; the max floored at 0 (the spconv layers') and the plain one
        floors = (True, False) if mode == "max" else (False,)
        for write_arg, zero_floor in itertools.product((False, True), floors):
            yield make_variant(POOL_FWD, dict(feats=feats, nmap=i32, out=feats, arg=i32, count=f32,
                                              rows=EXAMPLE_ROWS, C=INT_DIV16),
                               pool_forward_constexprs(mode, volume, write_arg, torch_dtype,
                                                       zero_floor))
        yield make_variant(POOL_BWD, dict(grad_out=feats, bmap=i32, arg=i32, count=f32,
                                          grad_in=feats, rows=EXAMPLE_ROWS, C=INT_DIV16),
                           pool_backward_constexprs(mode, volume, torch_dtype))


_VARIANTS_OF = {GATHER_GEMM: gather_gemm_variants, WGRAD: wgrad_variants}


def conv_variants(target: str, channels: Iterable[int] | None = None) -> list[Variant]:
    """The conv kernels' variants of one target: the launches dispatch makes there
    (flexplan.tuning.aot.conv_launches), one per specialization."""
    hip = TARGETS[target][0] == "hip"
    pairs = tuple(itertools.product(channels, repeat=2)) if channels is not None else None
    return list(_variants_of(conv_launches(target, hip, TARGET_SHARED_MEMORY[target], pairs), hip))


@functools.lru_cache(maxsize=64)
def _variants_of(launches: tuple[ConvLaunch, ...], hip: bool) -> tuple[Variant, ...]:
    # Launches that differ only in sizes of one int class are one specialization: group them
    # first (tens of thousands of launches, a few hundred variants), keeping their stable order
    # (a sampled build takes the first variants).
    groups = {}
    for launch in launches:
        p = launch.problem
        key = (launch.dtype, p.part, p.algo, p.v, launch.config,
               _int_example(p.ci, SPECIALIZED), _int_example(p.co, SPECIALIZED))
        groups.setdefault(key, launch)
    seen: dict[Variant, None] = {}
    for launch in groups.values():
        for variant in _VARIANTS_OF[launch.problem.family](launch, hip):
            seen.setdefault(variant, None)
    return tuple(seen)


def enumerate_variants(kernel_filter: str | None = None, channels: Iterable[int] | None = None,
                       targets: Iterable[str] | None = None) -> list[Variant]:
    """Every variant to build for these targets (default: all), deduplicated, in a stable order;
    kernel_filter keeps the kernels whose short name contains it; channels: cover these layer
    widths (every pair) instead of the default ones."""
    seen: dict[Variant, None] = {}
    for variant in itertools.chain(planner_variants(), segment_variants(), generative_variants(),
                                   view_variants(), check_variants(), im2col_variants(),
                                   pool_variants()):
        if not kernel_filter or kernel_filter in variant.kernel:
            seen.setdefault(variant, None)
    if not kernel_filter or any(kernel_filter in family for family in _VARIANTS_OF):
        channels = tuple(channels) if channels is not None else None
        for target in (targets or TARGETS):
            for variant in conv_variants(target, channels):
                if not kernel_filter or kernel_filter in variant.kernel:
                    seen.setdefault(variant, None)
    return list(seen)
