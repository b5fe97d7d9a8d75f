"""A finite kernel set: sizes, counts and places that change from call to call make no new Triton
specialization, so a job with new coordinates every step compiles nothing after its warm-up
and the AOT bundle can cover it.

Every launch of plan builds (hash table, schedule, strided plan, coordinate hash) and of a
forward + backward of a submanifold and a strided convolution is recorded for two coordinate
sets of other sizes (row counts divisible by 16 and not, other grids, explicit chunks at other
places, the plan's views at other offsets). Each launch's specialization comes from Triton's own
binder (CUDA rules, on these CPU tensors), as the JIT and the AOT build make it; the two sets
must be equal, and so must the launcher's call classes. On the CPU, kernels run through the
interpreter."""
from __future__ import annotations

import importlib
from dataclasses import replace

import pytest
import torch

from flexplan import ConvGeometry, build_plan, launcher
from flexplan.coords_hash import coords_digest
from flexplan.plan import GatherMap
from flexplan.workloads import random_coords

LAUNCHING_MODULES = ("flexplan.ops.conv", "flexplan.planner.hashmap",
                     "flexplan.planner.segments_triton", "flexplan.planner.generative_triton",
                     "flexplan.coords_hash")
GEOMETRIES = (ConvGeometry.submanifold_conv(3),
              ConvGeometry.make(2, stride=2, submanifold=False))
CHANNELS = 16
# (rows, grid): 96 rows (a multiple of 16) on a 12^3 grid, 75 on 10 x 10 x 11. Both keep the
# same configs (the heuristic's row tiles depend on the power of two at or above the rows, here
# and in the strided plans' outputs); the explicit forward of the submanifold conv runs in two
# chunks (see recorder), at other places for each size.
SIZES = ((96, (12, 12, 12)), (75, (10, 10, 11)))


def _binder():
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    backend = make_backend(GPUTarget("cuda", 90, 32))
    binders = {}

    def specialization(kernel, args, constexprs):
        fn = launcher.jit_function(kernel)
        if kernel not in binders:
            binders[kernel] = create_function_from_signature(fn.signature, fn.params, backend)
        _, spec, options = binders[kernel](*args, **constexprs)
        return fn.fn.__name__, tuple(spec), tuple(sorted(options.items()))
    return specialization


@pytest.fixture
def recorder(monkeypatch):
    """Record (kernel, Triton specialization, launcher call class) of every launch."""
    specialization, calls = _binder(), []
    real_launch = launcher.launch

    def recording_launch(kernel, grid, *args, **constexprs):
        calls.append((specialization(kernel, args, constexprs),
                      launcher._call_key(kernel, 0, args, constexprs)))
        return real_launch(kernel, grid, *args, **constexprs)

    for name in LAUNCHING_MODULES:
        monkeypatch.setattr(importlib.import_module(name), "launch", recording_launch)
    # The explicit algorithm in several chunks: other row_start / rows per chunk.
    monkeypatch.setattr(importlib.import_module("flexplan.ops.conv"),
                        "EXPLICIT_WORKSPACE_BYTES", 120_000)
    return calls


def _shifted(t: torch.Tensor, by: int) -> torch.Tensor:
    """t's values in a view `by` elements into a bigger buffer (another alignment)."""
    buffer = t.new_zeros(t.numel() + by)
    buffer[by:] = t
    return buffer[by:]


def _moved_views(plan, by: int):
    """The plan with its views into shared buffers at other places, as a planner that packs
    them differently would make them."""
    def gmap(g):
        return GatherMap(g.neighbor_map, g.sorted_idx,
                         {b: _shifted(t, by) for b, t in g.valid_kernel.items()},
                         {b: _shifted(t, by) for b, t in g.valid_kernel_seg.items()})
    return replace(plan, fwd=gmap(plan.fwd), bwd=None if plan.bwd is None else gmap(plan.bwd),
                   valid_signal_i=_shifted(plan.valid_signal_i, by),
                   valid_signal_o=_shifted(plan.valid_signal_o, by + 1),
                   valid_signal_seg=_shifted(plan.valid_signal_seg, by + 2))


def _run(rows: int, grid, seed: int, move_views: int = 0):
    from flexplan.ops.conv import sparse_conv

    gen = torch.Generator().manual_seed(seed)
    coords = random_coords(4 * rows, grid, batch_size=1, generator=gen)[:rows]
    assert coords.shape[0] == rows
    coords_digest(coords, use_triton=True)
    for geometry in GEOMETRIES:
        plan = build_plan(coords, grid, 1, geometry, backend="triton")
        if move_views:
            plan = _moved_views(plan, move_views)
        feats = torch.randn(rows, CHANNELS, generator=gen).requires_grad_()
        weight = torch.randn(CHANNELS, *geometry.kernel_size, CHANNELS, generator=gen,
                             requires_grad=True)
        bias = torch.randn(CHANNELS, generator=gen, requires_grad=True)
        for algo in ("auto", "masked", "explicit"):
            sparse_conv(feats, plan, weight, bias, algo=algo).square().sum().backward()


def test_varying_sizes_make_no_new_specialization(recorder):
    runs = []
    for seed, (rows, grid) in enumerate(SIZES):
        recorder.clear()
        _run(rows, grid, seed)
        runs.append(list(recorder))
    recorder.clear()
    _run(*SIZES[1], seed=7, move_views=1)
    runs.append(list(recorder))

    kernels = {spec[0] for spec, _ in runs[0]}
    assert kernels >= {"conv_gather_gemm_kernel", "conv_wgrad_kernel", "im2col_kernel",
                       "im2col_channel_major_kernel", "hash_insert_kernel",
                       "submanifold_neighbor_map_kernel", "gray_rank_kernel",
                       "schedule_offsets_kernel", "pairs_kernel", "plan_hash_kernel",
                       "generative_candidates_kernel", "run_starts_kernel",
                       "generative_scatter_kernel"}, kernels
    specs = [{spec for spec, _ in run} for run in runs]
    for other in specs[1:]:
        assert other == specs[0], ("new specializations", sorted(other - specs[0], key=repr),
                                   "gone", sorted(specs[0] - other, key=repr))
    classes = [{key for _, key in run} for run in runs]
    for other in classes[1:]:
        assert other == classes[0]  # the launcher keeps serving the same classes, no re-resolution
    # Two calls of one class take one binary: the class determines the specialization.
    binary_of = {}
    for run in runs:
        for spec, key in run:
            assert binary_of.setdefault(key, spec) == spec


def test_call_classes_follow_the_decorators():
    """The launcher leaves out exactly what a kernel's decorator says Triton does not specialize."""
    from flexplan.kernels_src.conv_gather_gemm import conv_gather_gemm_kernel as kernel

    fn = launcher.jit_function(kernel)
    how = dict(zip(fn.arg_names, launcher.arg_specialization(kernel)))
    assert how["M"] == how["valid_kernel_ptr"] == how["tile_counts_ptr"] == launcher.NOT_SPECIALIZED
    assert how["K"] == how["N"] == how["src_ptr"] == how["partials_ptr"] == launcher.SPECIALIZED
    t = torch.zeros(64, dtype=torch.int32)
    f = torch.zeros(64)
    args = [f, f, f, t, t, t, t, t, f, f, t, f, f, f, f, 1e-3, 16, 32, 64, 27]

    def key(**changes):
        call = list(args)
        for name, value in changes.items():
            call[fn.arg_names.index(name)] = value
        return launcher._call_key(kernel, 0, tuple(call), {"BLOCK_M": 64})

    assert key(M=16) == key(M=17) == key(M=1)                  # rows: any size
    assert key(valid_kernel_ptr=t[1:]) == key()                 # a view at any place
    assert key(M=2**31) != key()                                # (still: the integer width)
    assert key(K=17) != key() and key(K=1) != key(K=17)         # channels: specialized
    assert key(src_ptr=f[1:]) != key()                          # features: alignment kept


@pytest.mark.gpu
def test_new_sizes_every_step_compile_nothing_after_warmup():
    """A training loop's view on the GPU: coordinates of a new size every step (submanifold and
    strided plans built on the GPU, fp16 forward + backward, algo auto); after a warm-up over
    the range's ends and points between, Triton compiles nothing (its post-compile hook counts
    real compilations only: binaries served by an AOT bundle are not compilations)."""
    import triton

    from flexplan.ops.conv import sparse_conv

    compiled = []
    previous = triton.knobs.runtime.jit_post_compile_hook
    triton.knobs.runtime.jit_post_compile_hook = lambda *, repr, **_: compiled.append(repr)
    gen = torch.Generator().manual_seed(0)
    grid, low, high = (128, 128, 128), 60_000, 90_000
    geometries = GEOMETRIES + (ConvGeometry.make(3, stride=2, padding=1, submanifold=False),)

    def step(rows: int) -> None:
        coords = random_coords(2 * rows, grid, batch_size=1, generator=gen)[:rows].cuda()
        for geometry in geometries:
            plan = build_plan(coords, grid, 1, geometry)
            feats = torch.randn(rows, 32, device="cuda", dtype=torch.float16, requires_grad=True)
            weight = torch.randn(32, *geometry.kernel_size, 32, device="cuda", dtype=torch.float16,
                                 requires_grad=True)
            bias = torch.randn(32, device="cuda", dtype=torch.float16, requires_grad=True)
            sparse_conv(feats, plan, weight, bias).float().square().sum().backward()

    try:
        for rows in range(low, high + 1, (high - low) // 6):  # warm-up
            step(rows)
        torch.cuda.synchronize()
        warm = len(compiled)
        for _ in range(20):
            step(int(torch.randint(low, high, (1,), generator=gen)))
        torch.cuda.synchronize()
    finally:
        triton.knobs.runtime.jit_post_compile_hook = previous
    assert compiled[warm:] == [], compiled[warm:]
