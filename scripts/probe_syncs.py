"""Where a fresh-coordinate step waits for the GPU: every host sync torch reports
(torch.cuda.set_sync_debug_mode) during flexplan train / inference steps of the bench_e2e
networks (fp16, a new LiDAR batch every step), grouped by the flexplan line that caused it;
then the host's wall time per step inside plan lookups and builds (plan_provider.tensor_plan),
convolutions (ops.conv.sparse_conv, forward), the backward pass (Tensor.backward) and the
convolutions' part of it (SparseConvFunction.backward), BatchNorm (F.batch_norm, both ways
through autograd: its forward only) and the optimizer step.

Usage (GPU): python3 scripts/probe_syncs.py [--steps 3] [--timed 20] [--detail] [--impl spconv]
"""
from __future__ import annotations

import argparse
import collections
import importlib
import os
import sys
import tempfile
import time
import traceback
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("FLEXPLAN_CACHE_DIR", tempfile.mkdtemp(prefix="flexplan-syncs-"))

import flexplan.nn.spconv as sp  # noqa: E402
import flexplan.plan_provider as plan_provider  # noqa: E402
from e2e_networks import LidarUNet, VoxelResBackBone8x  # noqa: E402
from bench_e2e import MODES  # noqa: E402
from profile_host import step_fn  # noqa: E402
from flexplan.workloads import lidar_batch, lidar_scans  # noqa: E402

DETAIL = SYNC_BEFORE = False
NETS = {"encoder": VoxelResBackBone8x, "unet": LidarUNet}


def sync_site() -> str:
    """The innermost flexplan frame of the current stack (else the innermost non-torch one)."""
    frames = traceback.extract_stack()[:-3]
    for frame in reversed(frames):
        if "/flexplan/" in frame.filename:
            return f"{frame.filename.split('/flexplan/')[-1]}:{frame.lineno} {frame.name}"
    for frame in reversed(frames):
        if "torch" not in frame.filename and "warnings" not in frame.filename:
            return f"{os.path.basename(frame.filename)}:{frame.lineno} {frame.name}"
    return "?"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3, help="steps of the sync count")
    parser.add_argument("--timed", type=int, default=20, help="steps of the host times")
    parser.add_argument("--detail", action="store_true",
                        help="each get_plan (g) and sparse_conv (s) call's median host ms")
    parser.add_argument("--sync-before", action="store_true",
                        help="synchronize before each timed call (not timed)")
    parser.add_argument("--networks", default="encoder,unet")
    parser.add_argument("--phases", default="infer,train")
    parser.add_argument("--impl", default="flexplan", choices=("flexplan", "spconv"),
                        help="spconv: the same steps and parts on spconv (its convolutions' "
                             "parts read 0)")
    args = parser.parse_args()
    lib = sp
    if args.impl == "spconv":
        import spconv.pytorch as lib
    global DETAIL, SYNC_BEFORE
    DETAIL, SYNC_BEFORE = args.detail, args.sync_before
    device = torch.device("cuda")
    scans = lidar_scans(2, 0, device)
    for name in args.networks.split(","):
        cls = NETS[name]
        for phase in args.phases.split(","):
            torch.manual_seed(0)
            net = cls(lib).to(device).half()
            opt = torch.optim.SGD(net.parameters(), lr=1e-3)
            batches = [lidar_batch(i, 2, 0, device, scans=scans)
                       for i in range(5 + args.steps + args.timed)]
            batches = [b._replace(features=b.features.half()) for b in batches]
            step = step_fn(net, opt, phase, MODES["fp16"], lib)

            for b in batches[:5]:
                step(b)
            torch.cuda.synchronize()
            timed = time_parts(step, batches[5 + args.steps:])
            torch.cuda.synchronize()
            sites = collections.Counter()
            original = warnings.showwarning
            torch.cuda.set_sync_debug_mode("warn")
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("always")
                    warnings.showwarning = lambda *a, **k: sites.update([sync_site()])
                    for b in batches[5:5 + args.steps]:
                        step(b)
            finally:
                torch.cuda.set_sync_debug_mode(0)
                warnings.showwarning = original
            torch.cuda.synchronize()
            total = sum(sites.values())
            print(f"== {name} {phase}: {total / args.steps:.1f} syncs per step")
            for site, count in sites.most_common():
                print(f"  {count / args.steps:5.1f}  {site}")
            print("  host ms per step: " + ", ".join(f"{k} {v:.2f}" for k, v in timed.items()))


def time_parts(step, batches) -> dict:
    """Median wall ms per step: the whole step (synchronized), and the host time inside
    get_plan, sparse_conv, the backward pass, the convolutions' backward, BatchNorm's forward,
    the optimizer step, the input SparseConvTensor's construction (per part, outermost calls
    only), and the wait for the GPU at the step's end."""
    totals = {"get_plan": 0.0, "sparse_conv": 0.0, "backward": 0.0, "conv_backward": 0.0,
              "batch_norm": 0.0, "optimizer": 0.0, "input_tensor": 0.0, "end_sync": 0.0}
    depth = dict.fromkeys(totals, 0)
    calls = []  # (name, ms) of the outermost get_plan / sparse_conv calls, in order

    def timing(name, fn):
        def wrapper(*args, **kwargs):
            if depth[name]:
                return fn(*args, **kwargs)
            depth[name] += 1
            if SYNC_BEFORE:  # an idle GPU at the call: does its host time depend on the queue?
                torch.cuda.synchronize()
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                took = time.perf_counter() - start
                totals[name] += took
                if name in ("get_plan", "sparse_conv"):
                    calls.append((name, took * 1e3))
                depth[name] -= 1
        return wrapper

    # (flexplan.ops re-exports the function under its module's name: fetch the module itself)
    conv_module = importlib.import_module("flexplan.ops.conv")
    real_plan = plan_provider.tensor_plan
    real_conv = conv_module.sparse_conv
    modules = [m for m in list(sys.modules.values())
               if getattr(m, "sparse_conv", None) is real_conv]
    plan_users = [m for m in list(sys.modules.values())
                  if getattr(m, "tensor_plan", None) is real_plan]
    patches = [(m, "sparse_conv", real_conv, timing("sparse_conv", real_conv)) for m in modules]
    # (the layers' own name for it, and plan_provider's)
    patches += [(m, "tensor_plan", real_plan, timing("get_plan", real_plan)) for m in plan_users]
    function = conv_module.SparseConvFunction
    real_backward = function.__dict__["backward"]
    patches += [
        (function, "backward", real_backward,
         staticmethod(timing("conv_backward", real_backward.__func__))),
        (torch.Tensor, "backward", torch.Tensor.backward,
         timing("backward", torch.Tensor.backward)),
        (torch.nn.functional, "batch_norm", torch.nn.functional.batch_norm,
         timing("batch_norm", torch.nn.functional.batch_norm)),
        (torch.optim.SGD, "step", torch.optim.SGD.__dict__["step"],
         timing("optimizer", torch.optim.SGD.__dict__["step"])),
    ]
    # The step's input tensor (its coordinate check), whichever library's tensor the step makes.
    for name in ("flexplan.nn.spconv", "spconv.pytorch"):
        cls = getattr(sys.modules.get(name), "SparseConvTensor", None)
        if cls is not None and "__init__" in cls.__dict__:
            real_init = cls.__dict__["__init__"]
            patches.append((cls, "__init__", real_init, timing("input_tensor", real_init)))
    for owner, name, _, patched in patches:
        setattr(owner, name, patched)
    steps = []
    try:
        for b in batches:
            start = time.perf_counter()
            step(b)
            launched = time.perf_counter()
            torch.cuda.synchronize()  # the GPU work still queued when the host is done
            steps.append(time.perf_counter() - start)
            totals["end_sync"] += time.perf_counter() - launched
    finally:
        for owner, name, real, _ in patches:
            setattr(owner, name, real)
    steps.sort()
    if DETAIL:  # per call position within a step: the median over the steps
        per_step = len(calls) // len(batches)
        if per_step * len(batches) == len(calls):
            cols = [sorted(calls[i + k * per_step][1] for k in range(len(batches)))
                    for i in range(per_step)]
            print("  calls: " + " ".join(f"{calls[i][0][0]}{c[len(c) // 2]:.2f}"
                                         for i, c in enumerate(cols)))
    return {"step": steps[len(steps) // 2] * 1e3,
            **{k: v / len(batches) * 1e3 for k, v in totals.items()}}


if __name__ == "__main__":
    main()
