"""Plan cache costs on sphere shells: build vs key vs disk load vs memory hit, and what the auto
policy does. One GPU call; on CPU it runs at small sizes (python scripts/bench_cache.py --sizes 32 64).

Per resolution R: N voxels, plan bytes (memory / file), build time (planner, synced), key time,
file write time, disk-load-to-device time (page cache warm: file just written; pinned buffer +
non_blocking copies + widening), memory-hit time (cached_plan with the plan in memory), and
cached_plan in "auto" mode in a fresh process-like cache (empty memory, file on disk) after one
build was timed: the policy loads only where that beats rebuilding.
Results go to scripts/results/bench_cache.md (and $OUT if set).
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
import triton

from flexplan import ConvGeometry, build_plan
from flexplan.cache import PlanCache
from flexplan.cache.format import plan_nbytes, plan_problem, read_plan
from flexplan.cache.key import plan_key
from flexplan.cache.policy import Policy
from flexplan.workloads import sphere_shell

from bench_common import today

DATE = today()
BACKEND = "auto"  # the GPU hash-table planner on a GPU, the torch planner on the CPU


def timed(fn, device, repeat=3):
    """Median seconds of fn() over `repeat` runs (synchronized), and the last result."""
    times, result = [], None
    for _ in range(repeat):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        result = fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def bench_one(R, device, geom, workdir, repeat):
    coords = sphere_shell(R, device=device)
    shape, n = (R, R, R), coords.shape[0]
    build_s, plan = timed(lambda: build_plan(coords, shape, 1, geom, backend=BACKEND, check=False), device, repeat)
    key_s, key = timed(lambda: plan_key(coords, shape, 1, geom), device, max(repeat, 5))
    directory = workdir / f"R{R}"
    writer = PlanCache(directory, Policy(mode="always"))
    write_s, _ = timed(lambda: writer.put(coords, shape, 1, geom, plan, key=key,
                                          build_seconds=build_s), device, 1)
    path = writer.disk.path(key)
    load_s, loaded = timed(lambda: read_plan(path, device, expect_key=key)[0], device, repeat)
    # The load's validation of every index (format.plan_problem; part of load_ms above), alone.
    check_s, problem = timed(lambda: plan_problem(loaded), device, max(repeat, 5))
    assert problem is None
    assert all(torch.equal(a, b) for a, b in zip(plan.tensors().values(), loaded.tensors().values()))
    hit_s, _ = timed(lambda: writer.get_or_build(coords, shape, 1, geom, backend=BACKEND, check=False), device, max(repeat, 5))
    # A fresh cache in auto mode that has timed one build (of another coordinate set) on this
    # device, finding the file on disk: it loads only where that beats rebuilding.
    auto = PlanCache(directory, Policy(mode="auto"))
    auto.policy.record_build(device.type, n * geom.volume, build_s)
    auto.admission.record(key)  # a key seen before (admission.py): the disk is consulted

    def auto_call():
        auto.memory.clear()
        return auto.get_or_build(coords, shape, 1, geom, backend=BACKEND, check=False)

    auto_s, _ = timed(auto_call, device, repeat)
    st = auto.stats()
    choice = "load" if st.get("disk_hits") else "rebuild"
    file_bytes = path.stat().st_size
    shutil.rmtree(directory)
    del plan, loaded
    return dict(R=R, N=n, plan_mb=plan_nbytes(writer.memory.items()[0][1]) / 2**20,
                file_mb=file_bytes / 2**20, build_ms=build_s * 1e3, key_ms=key_s * 1e3,
                write_ms=write_s * 1e3, load_ms=load_s * 1e3, check_ms=check_s * 1e3,
                hit_ms=hit_s * 1e3,
                auto_ms=auto_s * 1e3, auto=choice)


def train_demo_lines() -> list[str]:
    """Two epochs of the DataLoader training demo (plans built in workers, then from disk)."""
    import subprocess
    import sys

    script = Path(__file__).parent / "train_demo_cache.py"
    proc = subprocess.run([sys.executable, str(script), "--workers", "4"], capture_output=True,
                          text=True)
    lines = [line for line in proc.stdout.splitlines() if not line.startswith("device")]
    head = [line.split(", cache ")[0] for line in proc.stdout.splitlines() if line.startswith("device")]
    print("\n".join(head + lines + proc.stderr.splitlines()[-5:]), flush=True)
    return head + lines if proc.returncode == 0 else [f"failed: {proc.stderr[-500:]}"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=None)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--cpu-sizes", type=int, nargs="*", default=None,
                        help="also time CPU builds vs CPU loads (the DataLoader-worker case)")
    parser.add_argument("--train-demo", action="store_true", help="also run the 2-epoch training demo")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    sizes = args.sizes or ([64, 256, 512, 1024] if device.type == "cuda" else [32, 64])
    cpu_sizes = args.cpu_sizes if args.cpu_sizes is not None else ([64, 256] if device.type == "cuda" else [])
    geom = ConvGeometry.submanifold_conv(3)
    workdir = Path(tempfile.mkdtemp(prefix="bench_cache_"))
    build_plan(sphere_shell(32, device=device), (32,) * 3, 1, geom, backend=BACKEND)  # warm up

    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    lines = [f"# Plan cache benchmark ({DATE})", "",
             f"Device: {name}; torch {torch.__version__}, Triton {triton.__version__}; "
             f"{os.cpu_count()} CPU cores; planner backend {BACKEND!r}. Sphere shells (thickness 1), batch 1, 3x3x3 submanifold; "
             f"median of {args.repeat}. Disk loads read a file just written (page cache warm).", "",
             "| target | R | N | plan MiB | file MiB | build ms | key ms | write ms | disk load ms | of it: check ms | memory hit ms | auto ms (choice) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    rows = [(device.type, R, device) for R in sizes] + [("cpu", R, torch.device("cpu")) for R in cpu_sizes]
    for target, R, dev in rows:
        r = bench_one(R, dev, geom, workdir, args.repeat)
        line = (f"| {target} | {r['R']} | {r['N']:,} | {r['plan_mb']:.1f} | {r['file_mb']:.1f} | "
                f"{r['build_ms']:.2f} | {r['key_ms']:.3f} | {r['write_ms']:.1f} | {r['load_ms']:.2f} | {r['check_ms']:.2f} | "
                f"{r['hit_ms']:.3f} | {r['auto_ms']:.2f} ({r['auto']}) |")
        print(line, flush=True)
        lines.append(line)
    shutil.rmtree(workdir, ignore_errors=True)
    if args.train_demo:
        lines += ["", "## scripts/train_demo_cache.py --workers 4 (same run)", "", "```",
                  *train_demo_lines(), "```"]
    lines += ["", "check ms: the load's validation of every index of the plan (ranges, monotone "
              "segments; format.plan_problem), included in disk load ms. "
              "key ms: the 128-bit coordinate hash on the device (the cost every cached call pays). "
              "auto ms: cached_plan with empty memory and the file on disk, after the policy has timed "
              "one build on this device: it loads where loading beats the build, else rebuilds "
              "(where a timed build beats any load's fixed latency it skips the disk: a rebuild plus the key)."]
    out = Path(__file__).parent / "results" / "bench_cache.md"
    out.parent.mkdir(exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    if os.environ.get("OUT"):
        shutil.copy(out, Path(os.environ["OUT"]) / out.name)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
