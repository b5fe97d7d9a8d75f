"""Where a long run on new coordinates makes the caching allocator ask the driver for memory:
bench_e2e's network steps on fresh LiDAR batches, the allocator's cudaMalloc / cudaFree counts
and reserved bytes per window of steps (does it settle, or grow?), the plan-build graphs
captured in each window, and for the last window the Python frames (flexplan's) of every new
segment (torch.cuda.memory._record_memory_history).

Usage (GPU): python3 scripts/probe_segments.py [--network unet] [--phase train]
             [--steps 60] [--window 10]
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("FLEXPLAN_CACHE_DIR", tempfile.mkdtemp(prefix="flexplan-segments-"))

from bench_e2e import MODES  # noqa: E402
from profile_host import NETS, lidar_batches, network_setup, step_fn  # noqa: E402

COUNTS = ("num_device_alloc", "num_device_free", "num_alloc_retries")


def kept_graphs() -> int:
    from flexplan.planner import build_graphs

    return len(build_graphs.kept())


def flexplan_frames(frames) -> str:
    names = [f"{os.path.basename(f['filename'])}:{f['line']}:{f['name']}" for f in frames
             if "flexplan" in f["filename"] or "scripts" in f["filename"]]
    return " < ".join(names[:5]) or "(no flexplan frame)"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--network", default="unet", choices=sorted(NETS))
    p.add_argument("--phase", default="train", choices=("train", "infer"))
    p.add_argument("--mode", default="fp16", choices=sorted(MODES))
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--window", type=int, default=10)
    args = p.parse_args()
    mode = MODES[args.mode]
    net, opt, scans, sp = network_setup(args.network, mode)
    batches = lidar_batches(range(args.steps), scans, mode)
    run = step_fn(net, opt, args.phase, mode, sp)
    print(f"{args.network} {args.phase} {args.mode}, fresh batches, {torch.cuda.get_device_name()}")
    last = (max(args.steps, 1) - 1) // args.window * args.window  # (the last window's start)
    for start in range(0, args.steps, args.window):
        if start == last:
            torch.cuda.memory._record_memory_history(enabled="all", context="alloc",
                                                     stacks="python", max_entries=200000)
        before = {k: torch.cuda.memory_stats().get(k, 0) for k in COUNTS}
        graphs = kept_graphs()
        for b in batches[start:start + args.window]:
            run(b)
            torch.cuda.synchronize()
        stats = torch.cuda.memory_stats()
        print(f"steps {start:3d}-{start + args.window - 1:3d}: " + ", ".join(
            f"{k} {stats.get(k, 0) - before[k]}" for k in COUNTS)
            + f"; graphs captured {kept_graphs() - graphs}; reserved "
            f"{torch.cuda.memory_reserved() / 2**20:.0f} MiB, allocated "
            f"{torch.cuda.memory_allocated() / 2**20:.0f} MiB")
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    sites = collections.Counter()
    sizes = collections.defaultdict(int)
    for trace in snapshot.get("device_traces", []):
        for event in trace:
            if event["action"] in ("segment_alloc", "segment_free"):
                site = f"{event['action']}: {flexplan_frames(event.get('frames', []))}"
                sites[site] += 1
                sizes[site] += event["size"]
    print(f"last window's new segments by site ({args.window} steps):")
    for site, count in sites.most_common(20):
        print(f"  {count:4d} x, {sizes[site] / count / 2**20:8.1f} MiB avg  {site}")


if __name__ == "__main__":
    main()
