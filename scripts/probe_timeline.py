"""Where a step's GPU sits idle and where its host waits: a torch.profiler trace of a few
steps of bench_e2e's networks (new LiDAR batches, synchronized between steps as bench_e2e
times them), read per step as
- wall: the step's host time (synchronize to synchronize),
- GPU busy: the union of the intervals of its kernels, memsets and copies,
- host waits: CUDA runtime calls that block the host (stream / event / device synchronize,
  device-to-host copies), their total, and the longest ones with the Python-side op that
  made them,
- GPU gaps: idle intervals of the GPU longer than --gap-us, with the host op running when
  the gap began.
In a step whose host work exceeds the GPU's (host-bound), wall ~ host time and the gaps are
the host's launches; where a wait is long, the GPU was behind the host and then idles while
the host catches up after it (a bubble on both sides).

Usage (GPU): python3 scripts/probe_timeline.py [--network unet] [--phase train] [--mode fp32]
             [--impl flexplan|spconv] [--steps 3] [--warmup 10] [--gap-us 50]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("FLEXPLAN_CACHE_DIR", tempfile.mkdtemp(prefix="flexplan-timeline-"))

from bench_e2e import MODES  # noqa: E402
from profile_host import NETS, lidar_batches, network_setup, step_fn  # noqa: E402

BLOCKING = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize",
            "cudaMemcpy", "cudaMemcpyAsync", "cuStreamSynchronize", "cuEventSynchronize")


def _union(intervals):
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--network", default="unet", choices=sorted(NETS))
    p.add_argument("--phase", default="train", choices=("train", "infer"))
    p.add_argument("--mode", default="fp32", choices=sorted(MODES))
    p.add_argument("--impl", default="flexplan", choices=("flexplan", "spconv"))
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--gap-us", type=float, default=50.0)
    p.add_argument("--top", type=int, default=12)
    args = p.parse_args()
    mode = MODES[args.mode]
    net, opt, scans, sp = network_setup(args.network, mode, args.impl)
    batches = lidar_batches(range(args.warmup + args.steps), scans, mode)
    run = step_fn(net, opt, args.phase, mode, sp)
    for b in batches[:args.warmup]:
        run(b)
        torch.cuda.synchronize()
    marks = []
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for b in batches[args.warmup:]:
            torch.cuda.synchronize()
            with torch.profiler.record_function("## step"):
                run(b)
                torch.cuda.synchronize()
    events = prof.events()
    steps = sorted((e.time_range.start, e.time_range.end) for e in events if e.name == "## step")
    # (the step's record_function range has a GPU-side twin spanning the step: not work)
    gpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA
           and not e.name.startswith("## ") and not getattr(e, "is_user_annotation", False)]
    cpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    ops = [e for e in cpu if not e.name.startswith("cuda") and not e.name.startswith("cu")
           and e.name != "## step"]
    print(f"{args.impl} {args.network} {args.mode} {args.phase} fresh, {torch.cuda.get_device_name()}")
    for k, (t0, t1) in enumerate(steps):
        kern = [(e.time_range.start, e.time_range.end) for e in gpu
                if t0 <= e.time_range.start < t1]
        waits = [e for e in cpu if e.name in BLOCKING and t0 <= e.time_range.start < t1]
        # the final synchronize of the step is the benchmark's, not the step's
        last = max(waits, key=lambda e: e.time_range.start, default=None)
        waits_in = [e for e in waits if e is not last]
        wait_us = sum(e.time_range.elapsed_us() for e in waits_in)
        print(f"step {k}: wall {(t1 - t0) / 1e3:.2f} ms, GPU busy {_union(kern) / 1e3:.2f} ms, "
              f"host waits {wait_us / 1e3:.2f} ms in {len(waits_in)} calls, "
              f"final drain {last.time_range.elapsed_us() / 1e3 if last else 0:.2f} ms")
        for e in sorted(waits_in, key=lambda e: -e.time_range.elapsed_us())[:args.top]:
            owner = max((o for o in ops if o.time_range.start <= e.time_range.start
                         <= o.time_range.end), key=lambda o: o.time_range.start, default=None)
            print(f"    wait {e.time_range.elapsed_us():8.1f} us {e.name:24s} at "
                  f"{(e.time_range.start - t0) / 1e3:6.2f} ms in {owner.name if owner else '?'}")
        kern.sort()
        gaps, end = [], t0
        for s, e in kern:
            if s - end > args.gap_us:
                gaps.append((s - end, end))
            end = max(end, e)
        print(f"  GPU gaps > {args.gap_us:.0f} us: {len(gaps)}, {sum(g for g, _ in gaps) / 1e3:.2f} ms")
        for g, at in sorted(gaps, reverse=True)[:args.top]:
            owner = max((o for o in ops if o.time_range.start <= at <= o.time_range.end),
                        key=lambda o: o.time_range.start, default=None)
            print(f"    gap {g:8.1f} us from {(at - t0) / 1e3:6.2f} ms, host in "
                  f"{owner.name if owner else '?'}")


if __name__ == "__main__":
    main()
