"""Strided / transposed plan build: flexplan's Triton planner vs its torch planner vs spconv 2.3's
index generation, one GPU run.

Sphere shells (batch 2) and, per shell, the encoder's strided shapes: 3x3x3 stride 2 padding 1,
padding (0, 1, 1), the (3, 1, 1) stride (2, 1, 1) head, and a 3x3x3 stride 2 transposed conv.
flexplan: build_plan(check=False) as the plan cache calls it (output coords, both gather maps,
their schedules, valid_signal), host syncs counted by torch.profiler. spconv:
get_indice_pairs_implicit_gemm (MaskImplicitGemm, training: what SparseConv3d builds on a
GPU). Median ms of triton.testing.do_bench, the two timed in alternating rounds. Checks that the
Triton plan equals the torch plan. Writes scripts/results/bench_generative.md.

Usage: python scripts/bench_generative.py [--sizes 256 512]
"""
from __future__ import annotations

import argparse
import os
import statistics

import torch
import triton
from triton.testing import do_bench

from flexplan import ConvGeometry, build_plan
from flexplan.workloads import sphere_shell

from bench_common import host_launch_us, today

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "bench_generative.md")
ROUNDS = 3
GEOMETRIES = {
    "k3 s2 p1": ConvGeometry.make(3, stride=2, padding=1, submanifold=False),
    "k3 s2 p(0,1,1)": ConvGeometry.make(3, stride=2, padding=(0, 1, 1), submanifold=False),
    "k(3,1,1) s(2,1,1)": ConvGeometry.make((3, 1, 1), stride=(2, 1, 1), submanifold=False),
    "k3 s2 p1 transposed": ConvGeometry.make(3, stride=2, padding=1, submanifold=False,
                                             transposed=True),
}


def bench(fn):
    return do_bench(fn, warmup=5, rep=40, return_mode="median")


def syncs_of(fn) -> int:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(e.name in ("cudaStreamSynchronize", "cudaDeviceSynchronize") for e in prof.events())


def spconv_fn(coords, shape, batch, geom):
    try:
        from spconv.core import ConvAlgo
        from spconv.pytorch import ops
    except ImportError:
        return None
    return lambda: ops.get_indice_pairs_implicit_gemm(
        coords, batch, list(shape), ConvAlgo.MaskImplicitGemm, ksize=list(geom.kernel_size),
        stride=list(geom.stride), padding=list(geom.padding), dilation=list(geom.dilation),
        out_padding=[0, 0, 0], subm=False, transpose=geom.transposed, is_train=True)


def plans_equal(a, b) -> bool:
    ta, tb = a.tensors(), b.tensors()
    return ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", type=int, nargs="+", default=[256, 512])
    args = parser.parse_args()
    header = (f"GPU {torch.cuda.get_device_name()}; host {host_launch_us():.1f} us per small torch "
              f"launch; torch {torch.__version__}; Triton {triton.__version__}; date {today()}.")
    print(header, flush=True)
    lines = ["# bench_generative: strided / transposed plan builds, flexplan vs spconv 2.3", "",
             header, "", "| shell | geometry | N in | N out | triton ms | torch ms | spconv ms | "
             "spconv / triton | syncs triton | syncs torch | triton == torch |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in args.sizes:
        coords = sphere_shell(r, 2, device="cuda")
        shape = (r, r, r)
        for name, geom in GEOMETRIES.items():
            triton_fn = lambda: build_plan(coords, shape, 2, geom, backend="triton", check=False)
            torch_fn = lambda: build_plan(coords, shape, 2, geom, backend="torch", check=False)
            plan = triton_fn()
            equal = plans_equal(plan, torch_fn())
            theirs = spconv_fn(coords, shape, 2, geom)
            times = {"triton": [], "torch": [], "spconv": []}
            for _ in range(ROUNDS):
                times["triton"].append(bench(triton_fn))
                times["torch"].append(bench(torch_fn))
                if theirs is not None:
                    times["spconv"].append(bench(theirs))
            med = {k: statistics.median(v) if v else float("nan") for k, v in times.items()}
            row = (f"| R={r} | {name} | {coords.shape[0]} | {plan.num_out} | {med['triton']:.3f} | "
                   f"{med['torch']:.3f} | {med['spconv']:.3f} | {med['spconv'] / med['triton']:.2f}x | "
                   f"{syncs_of(triton_fn)} | {syncs_of(torch_fn)} | {equal} |")
            lines.append(row)
            print(row, flush=True)
            del plan
            torch.cuda.empty_cache()
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with open(RESULTS, "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
