"""The runtime-dispatchable kernel variants: kernel x dtype x config x specialization.

A Variant is one example call (argument kinds + constexprs + launch options) of one kernel; the
AOT build turns it into Triton's compile inputs with the JIT's own binder, so each variant is
exactly the specialization the JIT would compile for calls like it. Its ints are examples of
their class (_int_example), so the registry lists each specialization once; sizes, counts and
places are not specialized (each kernel's decorator says which), so one variant serves them all.

What is covered is defined once, in flexplan/tuning/aot.py: the layer shapes (widths,
geometries, dtypes, rows) and, for the convs, the launches dispatch makes for them on each
target (conv_launches: "auto"'s algorithm, the target's tuned table else the heuristic, on the
target's shared memory). How each of those is launched is written once too, in the launch
descriptions next to the launching code (flexplan/launch_spec.py: ops/conv.py, ops/pool.py,
planner/hashmap.py, planner/segments_triton.py, planner/generative_triton.py, coords_hash.py,
plan.py's views, cache/format.py's check, nn/sync_batchnorm.py): this module only says which
launches to build and `record`s each through its description, with example arguments, as the
runtime calls it. No argument list is written here. tests/test_aot.py records the real ops'
launches and checks the registry reproduces them, tests/test_aot_lean.py checks the conv
variants against what dispatch returns.
"""
from __future__ import annotations

import functools
import inspect
import itertools
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import torch

from ..kernel_configs import GATHER_GEMM, PLAN_BLOCK_SIZES, WGRAD
from ..launch_spec import UNREAD_ADDRESS, Address, Size, Tensor
from ..launcher import NOT_SPECIALIZED, SPECIALIZED, arg_specialization, jit_function
from ..plan import mirrored_signal_offsets
from ..tuning.aot import (AOT_DTYPES, AOT_GEOMETRIES, AOT_WIDTHS, STRIDED_VOLUMES,
                          SUBMANIFOLD_VOLUMES, ConvLaunch, conv_launches)
from .keys import TARGET_SHARED_MEMORY, TARGETS

# Example value of the ints no kernel specializes on (rows, grid extents, counts, places; the
# SIZE arguments of the launch descriptions): any serves.
EXAMPLE_ROWS = 256
# The explicit algorithm's gathers (im2col): picked by "auto" only for 16-bit layers of 768+
# channels (kernel_configs.EXPLICIT_MIN_CHANNELS), or asked for by name; 3x3x3 only.
EXPLICIT_VOLUMES = (27,)
EXPLICIT_CHANNELS = 1024  # (a multiple of 16, as the wide layers' widths are)
# Pool windows of the sparse U-Nets and detectors that pool: 2x2x2 and 3x3x3.
REP_POOL_VOLUMES = (8, 27)
# The example of each int32 class Triton compiles for (_int_example): 1, divisible by 16, other
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
BN_PACK, BN_FINALIZE = "batchnorm_pack", "batchnorm_finalize"
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
    BN_PACK: "batchnorm_stats:pack_kernel",
    BN_FINALIZE: "batchnorm_stats:finalize_kernel",
}
_SHORT_NAMES = {where: name for name, where in KERNELS.items()}


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


# id(kernel) -> (kernel, jit_function(kernel)); holding the kernel keeps its id its own.
_jit_functions: dict = {}


class _Size(int):
    """The example passed for a SIZE argument: an int that knows it is one (see _variant)."""


def record(describe: Callable, dtypes: dict | None = None, **given) -> Variant:
    """The Variant of the launch `describe` makes (a launch description: flexplan/launch_spec.py)
    when called with `given` (by name) and, for each of its other arguments, an example of the
    kind it is annotated with: a tensor of its dtype (a role's: `dtypes`, e.g. {"feature":
    "float16"}), or any int for a SIZE. Its `run` is a recorder: the description computes the
    launch's grid, argument list and constexprs as it does for the ops."""
    values = dict(given)
    for name, kind in _kinds(describe):
        if name in values:
            continue
        if isinstance(kind, Tensor):
            dtype = (dtypes or {}).get(kind.dtype, kind.dtype)
            if not isinstance(getattr(torch, dtype, None), torch.dtype):
                raise KeyError(f"{describe.__qualname__}: {name!r} is a {kind.dtype!r} tensor; "
                               "give that role's dtype (dtypes)")
            values[name] = ("tensor", dtype)
        elif isinstance(kind, Address):
            values[name] = _Size(UNREAD_ADDRESS)
        elif isinstance(kind, Size):
            values[name] = _Size(EXAMPLE_ROWS)
        else:
            raise TypeError(f"{describe.__qualname__}: the build must give {name!r} (annotated "
                            f"{kind!r}: neither a tensor kind nor SIZE)")
    calls = []
    describe(lambda kernel, grid, *args, **constexprs: calls.append((kernel, args, constexprs)),
             **values)
    if len(calls) != 1:
        raise RuntimeError(f"{describe.__qualname__} launched {len(calls)} kernels; a launch "
                           "description launches one")
    return _variant(describe, *calls[0])


@functools.lru_cache(maxsize=None)
def _kinds(describe: Callable) -> tuple[tuple[str, object], ...]:
    """(name, annotation) of each argument of a launch description after `run`; postponed
    annotations evaluated in its module (None where one does not evaluate)."""
    kinds = []
    for name in list(inspect.signature(describe).parameters)[1:]:
        kind = describe.__annotations__.get(name)
        if isinstance(kind, str):
            try:
                kind = eval(kind, describe.__globals__)  # noqa: S307 (the module's own annotation)
            except Exception:  # noqa: BLE001 (a type the module only names: not a kind)
                kind = None
        kinds.append((name, kind))
    return tuple(kinds)


def _variant(describe: Callable, kernel, args: tuple, constexprs: dict) -> Variant:
    """The Variant of one recorded call: tensors as they are, each int as the example of its
    class for the kernel's parameter (_int_example)."""
    fn = _jit_functions.get(id(kernel), (None, None))[1]
    if fn is None:  # (under TRITON_INTERPRET=1, jit_function makes one: once per kernel)
        fn = jit_function(kernel)
        _jit_functions[id(kernel)] = kernel, fn
    where = f"{fn.fn.__module__.rpartition('.')[2]}:{fn.fn.__name__}"
    if where not in _SHORT_NAMES:
        raise KeyError(f"{describe.__qualname__} launches {where}, which KERNELS does not list")
    params = fn.params
    if len(args) > len(params) or any(p.is_constexpr for p in params[:len(args)]) or any(
            not p.is_constexpr for p in params[len(args):]):
        raise TypeError(f"{describe.__qualname__} passes {len(args)} arguments to {where}, whose "
                        "runtime parameters are " + str([p.name for p in params if not p.is_constexpr]))
    unknown = set(constexprs) - set(fn.arg_names) - LAUNCH_OPTIONS
    if unknown:
        raise KeyError(f"{describe.__qualname__} passes {sorted(unknown)} to {where}, which has no "
                       "such parameters")
    out = []
    for arg, param, how in zip(args, params, arg_specialization(kernel)):
        if isinstance(arg, tuple):
            out.append(arg)
        elif isinstance(arg, int) and not isinstance(arg, bool):
            if isinstance(arg, _Size) and how != NOT_SPECIALIZED:
                raise TypeError(f"{describe.__qualname__} annotates {param.name!r} of {where} as "
                                "SIZE, but the kernel specializes it: annotate it int (the build "
                                "gives its value)")
            out.append(("int", _int_example(int(arg), how)))
        elif isinstance(arg, float):  # (fp32 to Triton, whatever its value)
            out.append(("float", 0.0))
        else:
            raise TypeError(f"{describe.__qualname__} passes {param.name}={arg!r} to {where}")
    return Variant(_SHORT_NAMES[where], tuple(out), tuple(sorted(constexprs.items())))


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
    """The launches of ops.conv.gather_gemm for one dispatched launch: grad-input over the
    forward map reversed (submanifold plans) or the backward map (the others); the forward,
    whose one binary serves every epilogue (none, bias, BatchNormReLU in either dtype: run-time
    arguments). The output is in the features' dtype, split-K or not (the kernel sums its
    accumulator-dtype partials)."""
    from ..ops.conv import launch_gather_gemm, reads_weight_kvn

    problem, cfg = launch.problem, launch.config
    feature = _torch_dtype(launch.dtype)
    dtypes = dict(feature=feature, output=feature, accumulator=_acc_dtype(launch.dtype))
    _, k, n = problem.gemm_mkn
    reverses = (True,) * (problem.v in SUBMANIFOLD_VOLUMES) + (False,) * (
        problem.v in STRIDED_VOLUMES) if problem.part == "dgrad" else ()
    for reverse in reverses or (False,):
        yield record(launch_gather_gemm, dtypes, k=k, n=n, v=problem.v, cfg=cfg,
                     masked=problem.algo.startswith("masked"), reverse=reverse, bn_eps=0.0,
                     dtype=launch.dtype, hip=hip,
                     weight_kvn=reads_weight_kvn(problem.part, launch.dtype))


def wgrad_variants(launch: ConvLaunch, hip: bool) -> Iterator[Variant]:
    """The launch of ops.conv.wgrad for one dispatched launch (its config already the dtype's:
    kernel_configs.precision_config), over a submanifold plan's mirrored offsets or all of a
    strided plan's; the gradient stored in the features' dtype or, split-K over 16-bit
    features, also float32 (an fp32 master weight under autocast: ops.conv.wgrad)."""
    from ..ops.conv import launch_wgrad

    problem, cfg = launch.problem, launch.config
    feature = _torch_dtype(launch.dtype)
    accumulator = _acc_dtype(launch.dtype)
    signals = ((mirrored_signal_offsets(problem.v),) * (problem.v in SUBMANIFOLD_VOLUMES)
               + (problem.v,) * (problem.v in STRIDED_VOLUMES))
    for signal, output in itertools.product(signals or (problem.v,),
                                            sorted({feature, accumulator} if cfg.splitk > 1
                                                   else {feature})):
        yield record(launch_wgrad, dict(feature=feature, output=output, accumulator=accumulator),
                     co=problem.co, ci=problem.ci, v=problem.v, signal_offsets=signal, cfg=cfg,
                     dtype=launch.dtype, hip=hip)


def _submanifold():
    return [g for g in AOT_GEOMETRIES if g.submanifold]


def _strided():
    return [g for g in AOT_GEOMETRIES if not g.submanifold]


def planner_variants() -> Iterator[Variant]:
    """The launches of flexplan.planner.hashmap: table build and submanifold neighbour map, for
    the submanifold geometries of AOT_GEOMETRIES."""
    from ..planner.hashmap import launch_hash_insert, launch_neighbor_map

    for key_64 in (False, True):
        for volume in sorted({1} | {g.volume for g in _submanifold()}):  # 1: coords_problems
            for map_t in (False, True):  # (True: a first sighting's unscheduled map)
                yield record(launch_hash_insert, volume=volume, key_64=key_64, lanes=False,
                             map_t=map_t)
        # the input check, hashing the coordinates' identity in the same pass
        yield record(launch_hash_insert, volume=1, key_64=key_64, lanes=True, map_t=False)
        for geometry in _submanifold():
            for map_t in (False, True):
                yield record(launch_neighbor_map, geometry=geometry, key_64=key_64, map_t=map_t)


def segment_variants() -> Iterator[Variant]:
    """The launches of flexplan.planner.segments_triton (Gray-code order, per-block offsets,
    grad-weight pairs) and of the plan cache's coordinate hash (flexplan.coords_hash), for the
    volumes of AOT_GEOMETRIES."""
    from ..coords_hash import launch_plan_hash
    from ..planner import segments_triton as seg
    from ..planner.segments import rank_words

    for v in sorted({g.volume for g in AOT_GEOMETRIES}):
        bits, dtype, words = rank_words(v)
        word = dict(words=str(dtype).removeprefix("torch."))
        yield record(seg.launch_gray_rank, word, v=v, words=words, word_bits=bits)
        # (no size is specialized: one row count serves all)
        layout = seg.schedule_layout(EXAMPLE_ROWS, v, PLAN_BLOCK_SIZES, 0)
        # build_plan (two flags: the coords check) and the schedule alone; scans of int32 and int64
        for num_flags, scan in itertools.product((0, 2), ("int32", "int64")):
            yield record(seg.launch_schedule, dict(word, scan=scan), layout=layout, v=v,
                         words=words, word_bits=bits, num_flags=num_flags)
        # submanifold plans keep the mirrored half of the offsets, the others all of them
        offsets = ((mirrored_signal_offsets(v),) * (v in SUBMANIFOLD_VOLUMES)
                   + (v,) * (v in STRIDED_VOLUMES))
        for signal, scan in itertools.product(offsets, ("int32", "int64")):
            yield record(seg.launch_pairs, dict(scan=scan), v=v, signal_offsets=signal)
    yield record(launch_plan_hash)


def generative_variants() -> Iterator[Variant]:
    """The launches of flexplan.planner.generative_triton (strided and transposed plans; their
    schedules: segment_variants), for the strided and transposed geometries of AOT_GEOMETRIES
    and both key dtypes."""
    from ..planner import generative_triton as gen, segments

    for geometry, key_dtype in itertools.product(_strided(), (torch.int32, torch.int64)):
        keys = dict(keys=str(key_dtype).removeprefix("torch."))
        sent, slots = gen.SENTINEL[key_dtype], gen.candidate_slots(geometry)
        yield record(gen.launch_candidates, keys, geometry=geometry, slots=slots, sent=sent)
        yield record(gen.launch_run_starts, keys, sent=sent)
        # The fwd map and output coordinates; the bwd map only where training builds schedule
        # it (planner.segments.SCHEDULE_BWD_MAPS, an A/B switch: else it is the fwd map
        # transposed, below).
        for write_fwd in (True,) if not segments.SCHEDULE_BWD_MAPS else (False, True):
            yield record(gen.launch_scatter, keys, slots=slots, v=geometry.volume, sent=sent,
                         write_fwd=write_fwd)
    for volume in sorted(STRIDED_VOLUMES):  # a bwd map made from the fwd map
        # (True: with its gather layout, a training build's and an inverse conv's over an
        # inference plan; False: the pool backward's view, a scheduled inverse map)
        for map_t in (False, True):
            yield record(gen.launch_transpose_map, v=volume, map_t=map_t)


def view_variants() -> Iterator[Variant]:
    """The launches of GatherMap.sorted_map_t and GatherMap.chunk_order (flexplan/plan.py): one
    specialization each (rows, volume and the places of sorted_idx are not specialized)."""
    from ..kernel_configs import SCHEDULE_CHUNK
    from ..plan import launch_chunk_order, launch_sorted_map_t

    yield record(launch_sorted_map_t)
    yield record(launch_chunk_order, chunk=SCHEDULE_CHUNK)


def check_variants() -> Iterator[Variant]:
    """The plan-file load check (flexplan/cache/format.py, plan_problem): one specialization."""
    from ..cache.format import launch_plan_check

    yield record(launch_plan_check)


def _feature_dtypes() -> list[str]:
    """The torch dtypes of the covered dtypes (tf32 is float32)."""
    return sorted({_torch_dtype(d) for d in AOT_DTYPES})


def im2col_variants() -> Iterator[Variant]:
    """The launches of ops.conv._im2col_chunks (the explicit algorithm's gathers), for every
    feature dtype; their tiles are fixed, so rows and channels only vary the int classes."""
    from ..ops.conv import launch_im2col, launch_im2col_channel_major

    for dtype, v in itertools.product(_feature_dtypes(), EXPLICIT_VOLUMES):
        feature = dict(feature=dtype)
        yield record(launch_im2col, feature, k=EXPLICIT_CHANNELS, v=v)
        for reverse in (False, True):  # grad-input of strided plans, of submanifold ones
            yield record(launch_im2col_channel_major, feature, k=EXPLICIT_CHANNELS, v=v,
                         reverse=reverse)


def pool_variants() -> Iterator[Variant]:
    """The launches of ops.pool (max / avg, forward with and without what the backward reads,
    backward) for the covered feature dtypes, channel counts divisible by 16 (others
    JIT-compile) and REP_POOL_VOLUMES."""
    from ..ops.pool import launch_pool_backward, launch_pool_forward

    for dtype, mode, volume in itertools.product(_feature_dtypes(), ("max", "avg"), REP_POOL_VOLUMES):
        feature, torch_dtype = dict(feature=dtype), getattr(torch, dtype)
        # inference, training; the max floored at 0 (the spconv layers') and the plain one
        floors = (True, False) if mode == "max" else (False,)
        for write_arg, zero_floor in itertools.product((False, True), floors):
            yield record(launch_pool_forward, feature, channels=INT_DIV16, mode=mode, volume=volume,
                         write_arg=write_arg, dtype=torch_dtype, zero_floor=zero_floor)
        yield record(launch_pool_backward, feature, channels=INT_DIV16, mode=mode, volume=volume,
                     dtype=torch_dtype)


# The running statistics' dtype per statistics dtype (nn.sync_batchnorm._stats_dtype: float32 for
# 16-bit and float32 inputs, float64 for float64): the module's, i.e. float32 (an fp32 model,
# also under autocast), float16 / bfloat16 (model.half() / .bfloat16()); float64 for float64.
BN_RUNNING_DTYPES = {"float32": ("float32", "float16", "bfloat16"), "float64": ("float64",)}


def batchnorm_variants() -> Iterator[Variant]:
    """The launches of nn.sync_batchnorm's CUDA path (its statistics kernels around the
    all_reduce), for channel counts of the covered widths' int classes (others JIT-compile):
    the rank's sums; the global statistics without running statistics (track_running_stats
    False), with them by momentum and by the cumulative average (momentum None)."""
    from ..nn.sync_batchnorm import launch_finalize, launch_pack

    classes = sorted({_int_example(c, SPECIALIZED) for c in AOT_WIDTHS})
    for (stats, runnings), channels in itertools.product(BN_RUNNING_DTYPES.items(), classes):
        yield record(launch_pack, dict(stats=stats), channels=channels)
        yield record(launch_finalize, dict(stats=stats), running_mean=None, running_var=None,
                     channels=channels, track=False, cumulative=False)
        for running, cumulative in itertools.product(runnings, (False, True)):
            yield record(launch_finalize, dict(stats=stats, running=running), channels=channels,
                         track=True, cumulative=cumulative)


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
                                   pool_variants(), batchnorm_variants()):
        if not kernel_filter or kernel_filter in variant.kernel:
            seen.setdefault(variant, None)
    if not kernel_filter or any(kernel_filter in family for family in _VARIANTS_OF):
        channels = tuple(channels) if channels is not None else None
        for target in (targets or TARGETS):
            for variant in conv_variants(target, channels):
                if not kernel_filter or kernel_filter in variant.kernel:
                    seen.setdefault(variant, None)
    return list(seen)
