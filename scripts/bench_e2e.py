"""End to end (issues #20, #21): training steps and inference calls of two LiDAR networks on
changing coordinates, flexplan vs spconv 2.3 side by side, in one process on one GPU.

What users run, timed as they see it: wall clock per step with torch.cuda.synchronize() around
it, host work (plan builds, Python, launches) included.
- Networks (scripts/e2e_networks.py, one source for both libraries; the flexplan copy loads the
  spconv copy's state_dict): OpenPCDet's VoxelResBackBone8x encoder + `.dense()`, and a 4-level
  sparse U-Net with SparseInverseConv3d decoders and per-voxel logits.
- Data (flexplan.workloads.lidar_batch): batches of 2 ray-cast 64-beam LiDAR scans, augmented
  (flip, rotation, scale, translation) and voxelized on the Waymo grid of OpenPCDet
  (0.1 x 0.1 x 0.15 m, sparse_shape 41 x 1504 x 1504): about 100-120k voxels per batch.
- Rows: network x mode (--modes: fp16 = model.half() on fp16 features; fp32; amp-fp16 /
  amp-bf16 = torch.autocast around an fp32 model, fp16 with a GradScaler; bf16 = model.bfloat16())
  x train (forward, loss, backward, SGD step; BatchNorm training) / infer (eval, no_grad)
  x fresh (a new augmented batch every step, never repeated: each row has its own batches) /
  same (one batch, the same tensors, every step). spconv and flexplan run on the same batches:
  each warms up (the first of the two alternating between rows), then they take turns step by
  step (the order alternating), so that both see the host's speed of the same seconds; the
  paired speedup is the median of the per-step ratios. A failure is a row's error, never the
  run's end.
- Per flexplan run: Triton compilations during the timed steps (new entries in the compile
  caches of the JITFunctions of flexplan.kernels_src, less the binaries the AOT hook put there),
  plan files written to the plan cache directory (a fresh FLEXPLAN_CACHE_DIR per run) and the
  change of flexplan.plan_cache.stats().
- --profile: torch.profiler tables (top CPU and CUDA ops) of 5 fresh-coordinate train steps of
  each implementation, to stdout.

Writes scripts/results/bench_e2e.md (the table) and appends scripts/results/bench_e2e.jsonl
(one JSON line per row).

Usage (GPU): python3 scripts/bench_e2e.py [--steps 30] [--warmup 10] [--networks encoder,unet]
                 [--modes fp16,fp32,amp-fp16,amp-bf16,bf16] [--batch 2] [--no-spconv] [--profile]
CPU smoke:   TRITON_INTERPRET=1 python scripts/bench_e2e.py --small --no-spconv
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import importlib
import json
import os
import pkgutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.profiler import record_function

SCRIPTS = Path(__file__).resolve().parent
sys.path.insert(0, str(SCRIPTS))
from bench_common import time_paired  # noqa: E402
RESULTS = SCRIPTS / "results" / "bench_e2e.md"
IMPLS = ("spconv", "flexplan")


# ---------------------------------------------------------------- settings

@dataclass(frozen=True)
class Mode:
    """How the model and its inputs are cast."""

    name: str
    model_dtype: torch.dtype         # parameters and BatchNorm buffers
    input_dtype: torch.dtype         # voxel features
    autocast: torch.dtype | None = None  # torch.autocast(dtype) around forward + loss
    grad_scaler: bool = False        # fp16 autocast training as users run it: with a GradScaler


MODES = {m.name: m for m in (
    Mode("fp16", torch.float16, torch.float16),
    Mode("fp32", torch.float32, torch.float32),
    Mode("amp-fp16", torch.float32, torch.float32, torch.float16, grad_scaler=True),
    Mode("amp-bf16", torch.float32, torch.float32, torch.bfloat16),
    Mode("bf16", torch.bfloat16, torch.bfloat16),
)}


@dataclass(frozen=True)
class Sizes:
    grid: object                   # flexplan.workloads.VoxelGrid
    scan: dict = field(default_factory=dict)  # lidar_scan arguments
    base: int = 16                 # first-level channels of both networks
    scenes: int = 4                # distinct scenes the batches cycle through


def sizes_for(small: bool) -> Sizes:
    from flexplan.workloads import SMALL_GRID, WAYMO_GRID

    if small:  # ~100 voxels, narrow layers: minutes through the interpreter, not hours
        return Sizes(SMALL_GRID, dict(beams=2, azimuth_steps=32, max_range=24.0, num_boxes=8,
                                      num_poles=4), base=4, scenes=2)
    return Sizes(WAYMO_GRID)


# ---------------------------------------------------------------- environment

def use_fresh_cache_root() -> Path:
    """Point FLEXPLAN_CACHE_DIR at a new temp dir, so no plan of an earlier run is found and the
    plan files this run writes can be counted; returns the plan directory. The AOT bundles and
    tuned tables of the previous root are linked in: kernels come from where they would for a
    user. Call before flexplan builds or launches anything."""
    from flexplan import paths

    previous = {"aot": paths.aot_cache_dir(), "tuning": paths.tuning_dir()}
    root = Path(tempfile.mkdtemp(prefix="flexplan-e2e-"))
    for name, path in previous.items():
        if path.is_dir():
            (root / name).symlink_to(path, target_is_directory=True)
    os.environ[paths.CACHE_DIR_ENV] = str(root)
    return paths.plan_cache_dir()


def plan_files(directory: Path) -> int:
    """Plan files in the plan cache directory (not the temp files of writes in progress)."""
    if not directory.is_dir():
        return 0
    return sum(1 for p in directory.iterdir() if p.name.endswith(".fxplan") and not p.name.startswith("."))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


COMMIT_ENV = "FLEXPLAN_BENCH_COMMIT"  # the commit to record, where the tree's git is not it


def git_commit() -> str:
    """The code's commit for a results file: FLEXPLAN_BENCH_COMMIT if set (a copied tree whose
    .git is another commit's: the GPU machine's copy), else HEAD, with "+changes" where the
    tracked files differ from it."""
    if os.environ.get(COMMIT_ENV):
        return os.environ[COMMIT_ENV]
    try:
        def git(*args):
            return subprocess.run(["git", *args], cwd=SCRIPTS, text=True, capture_output=True,
                                  timeout=10).stdout.strip()
        head = git("rev-parse", "--short", "HEAD") or "?"
        return head + ("+changes" if git("status", "--porcelain", "--untracked-files=no") else "")
    except Exception:  # no git, or not a checkout (a copied tree)
        return "?"


# ---------------------------------------------------------------- compilations

def flexplan_jit_functions() -> dict:
    """name -> JITFunction of every kernel defined in flexplan.kernels_src (none under
    TRITON_INTERPRET=1: the decorator makes interpreter functions)."""
    from triton.runtime.jit import JITFunction

    import flexplan.kernels_src as package

    found = {}
    for info in pkgutil.iter_modules(package.__path__):
        try:
            module = importlib.import_module(f"{package.__name__}.{info.name}")
        except Exception as exc:  # a module that does not import launches nothing
            print(f"compile counter: skipping kernels_src.{info.name} ({exc.__class__.__name__})")
            continue
        for name, obj in vars(module).items():
            if isinstance(obj, JITFunction) and obj.module == module.__name__:
                found[f"{info.name}.{name}"] = obj
    return found


def jit_cache_entries(functions: dict) -> dict:
    """Compiled variants held per kernel, all devices. JITFunction.device_caches maps a device to
    a tuple whose first item is its kernel cache, {specialization key: CompiledKernel} (Triton
    3.4-3.5: (cache, target, backend, binder); 3.6-3.9: (cache, key cache, target, backend,
    binder)). JIT compiles and binaries the AOT hook hands over both add an entry; a launch that
    finds its entry adds none. Only read: no hook is installed, so launches keep their fast path.
    """
    counts = {}
    for name, fn in functions.items():
        caches = getattr(fn, "device_caches", {})
        counts[name] = sum(len(entry[0]) for entry in list(caches.values()))
    return counts


@dataclass
class KernelSnapshot:
    jit: dict    # kernel -> compile-cache entries
    aot: dict    # flexplan.aot.runtime.stats: "aot" (bundle binaries loaded), "direct" (of those,
                 # launched through the driver API: never in a JIT cache), "jit" (hook misses)
    launch_classes: int  # flexplan.launcher's fast-path entries (argument classes seen)


def kernel_snapshot(functions: dict) -> KernelSnapshot:
    from flexplan import launcher
    from flexplan.aot import runtime

    return KernelSnapshot(jit_cache_entries(functions), dict(runtime.stats), len(launcher._calls))


def compile_delta(before: KernelSnapshot, after: KernelSnapshot) -> dict:
    """What was compiled or loaded between two snapshots."""
    new = {k: n - before.jit.get(k, 0) for k, n in after.jit.items() if n > before.jit.get(k, 0)}
    aot = {k: after.aot.get(k, 0) - before.aot.get(k, 0) for k in ("aot", "direct", "jit")}
    from_bundle_via_jit = aot["aot"] - aot["direct"]  # entries the AOT hook put in JIT caches
    entries = sum(new.values())
    return dict(compiles=max(entries - from_bundle_via_jit, 0), jit_cache_entries=entries,
                kernels=sorted(new), aot_loaded=aot["aot"], aot_direct=aot["direct"],
                aot_hook_misses=aot["jit"], new_launch_classes=after.launch_classes - before.launch_classes)


def numeric_delta(before: dict, after: dict) -> dict:
    """Changes of the numeric entries of two plan_cache.stats() dicts."""
    out = {}
    for key, value in after.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            change = value - before.get(key, 0)
            if change:
                out[key] = round(change, 6) if isinstance(change, float) else change
    return out


# ---------------------------------------------------------------- data

class BatchSource:
    """Batches of lidar_batch over a few scenes ray-cast once; every call to take() gets steps never
    handed out before, so no two rows (and no two steps of a fresh row) share coordinates."""

    def __init__(self, args, sizes: Sizes, device):
        from flexplan.workloads import lidar_scans

        self.args, self.sizes, self.device = args, sizes, device
        self.scans = lidar_scans(sizes.scenes, args.seed, device, **sizes.scan)
        self.next_step = 0
        self.voxels: list[int] = []

    def take(self, count: int, dtype: torch.dtype) -> list:
        from flexplan.workloads import lidar_batch

        batches = []
        for step in range(self.next_step, self.next_step + count):
            b = lidar_batch(step, self.args.batch, self.args.seed, self.device, self.sizes.grid,
                            scans=self.scans)
            self.voxels.append(b.indices.shape[0])
            batches.append(b._replace(features=b.features.to(dtype)))
        self.next_step += count
        sync(self.device)
        return batches


# ---------------------------------------------------------------- steps

def build_model(net_cls, sp, state: dict | None, mode: Mode, sizes: Sizes, device):
    torch.manual_seed(0)
    net = net_cls(sp, base=sizes.base).to(device)
    if state is not None:
        net.load_state_dict(state)  # spconv's state_dict, unchanged
    return net.to(mode.model_dtype)


def autocast(mode: Mode, device):
    if mode.autocast is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=mode.autocast)


def make_input(sp, batch):
    return sp.SparseConvTensor(batch.features, batch.indices, list(batch.spatial_shape),
                               batch.batch_size)


def train_step_fn(net, sp, mode: Mode, device):
    """One optimizer step per call, as a training loop runs it. The record_function ranges name
    the phases in --profile's tables (about a microsecond each when no profiler runs)."""
    net.train()
    opt = torch.optim.SGD(net.parameters(), lr=1e-3, momentum=0.9)
    scaler = torch.amp.GradScaler(device.type) if mode.grad_scaler else None

    def step(batch):
        opt.zero_grad(set_to_none=True)
        with record_function("e2e.forward"), autocast(mode, device):
            loss = net.loss(net(make_input(sp, batch)), batch.labels)
        with record_function("e2e.backward"):
            (loss if scaler is None else scaler.scale(loss)).backward()
        with record_function("e2e.optimizer"):
            if scaler is None:
                opt.step()
            else:
                scaler.step(opt)
                scaler.update()
    return step


def infer_step_fn(net, sp, mode: Mode, device):
    net.eval()

    def step(batch):
        with record_function("e2e.forward"), torch.no_grad(), autocast(mode, device):
            return net(make_input(sp, batch))
    return step


STEP_FNS = {"train": train_step_fn, "infer": infer_step_fn}


def timed(step, batches: list, device) -> list[float]:
    """Wall-clock ms of each step, synchronized before and after (what the user waits)."""
    times = []
    for batch in batches:
        sync(device)
        start = time.perf_counter()
        step(batch)
        sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return times


@dataclass
class Context:
    args: argparse.Namespace
    sizes: Sizes
    device: torch.device
    namespaces: dict          # impl -> spconv namespace
    plan_dir: Path
    kernels: dict             # flexplan_jit_functions()


def prepare_impl(ctx: Context, impl: str, net_cls, state, mode: Mode, phase: str,
                 batches: list) -> dict:
    """One implementation's model and step, warmed up on the first batches; the kernel and
    plan-file counts from before its warm-up. Exceptions are the caller's to catch."""
    sp, device = ctx.namespaces[impl], ctx.device
    net = build_model(net_cls, sp, state, mode, ctx.sizes, device)
    step = STEP_FNS[phase](net, sp, mode, device)
    start, files_start = kernel_snapshot(ctx.kernels), plan_files(ctx.plan_dir)
    timed(step, batches[:ctx.args.warmup], device)
    return dict(net=net, step=step, start=start, files_start=files_start)


def result_of(prepared: dict, ms: list[float], counts: dict) -> dict:
    """One implementation's cell: its timings and, with counts (flexplan's), what it compiled
    and cached during the timed steps and its warm-up."""
    result = dict(median_ms=statistics.median(ms), mean_ms=statistics.fmean(ms),
                  ms=[round(t, 3) for t in ms],
                  sparse_dtype=str(prepared["net"].last_sparse_dtype).removeprefix("torch."))
    if counts:
        before, after = counts["before"], counts["after"]
        result.update(timed_compiles=compile_delta(before, after),
                      warmup_compiles=compile_delta(prepared["start"], before),
                      plan_files_timed=counts["files_after"] - counts["files_before"],
                      plan_files_warmup=counts["files_before"] - prepared["files_start"],
                      plan_stats_timed=counts["stats"])
    return result


def short_error(exc: BaseException) -> str:
    text = f"{exc.__class__.__name__}: {exc}".strip().splitlines()[0]
    return text[:300]


def run_row(ctx: Context, source: BatchSource, net_name: str, net_cls, state, mode: Mode,
            phase: str, coords: str, first: str) -> dict:
    """One table row: both implementations on the same batches, each warmed up (`first`
    first), then their timed steps in turns (bench_common.time_paired)."""
    args = ctx.args
    if coords == "fresh":
        batches = source.take(args.warmup + args.steps, mode.input_dtype)
    else:
        batches = source.take(1, mode.input_dtype) * (args.warmup + args.steps)
    row = dict(network=net_name, mode=mode.name, phase=phase, coords=coords,
               voxels=round(statistics.fmean(b.indices.shape[0] for b in batches[args.warmup:])),
               steps=args.steps, warmup=args.warmup, first=first)
    from flexplan.cache import plan_cache

    order = [i for i in IMPLS if i in ctx.namespaces]
    if first != order[0]:
        order.reverse()
    prepared = {}
    for impl in order:
        try:
            prepared[impl] = prepare_impl(ctx, impl, net_cls, state, mode, phase, batches)
        except Exception as exc:  # one row's failure, reported in its cell
            traceback.print_exc(limit=4)
            row[impl] = dict(error=short_error(exc))
            with contextlib.suppress(Exception):
                sync(ctx.device)
    # (spconv compiles none of flexplan's kernels and writes no plan file: these are flexplan's)
    counts = dict(before=kernel_snapshot(ctx.kernels), files_before=plan_files(ctx.plan_dir))
    stats_before = plan_cache.stats()
    # the timed steps in turns (bench_common.time_paired): step i of each, the order
    # alternating with i, so that both see the host's speed of the same moments (these hosts
    # drift by tens of percent within minutes)
    failures, ms = {}, {}
    if prepared:
        ms = time_paired({impl: p["step"] for impl, p in prepared.items()},
                         batches[args.warmup:], 0, failures=failures)["times"]
    for impl, exc in failures.items():  # one implementation's failure, reported in its cell
        traceback.print_exception(exc, limit=4)
        row[impl] = dict(error=short_error(exc))
    counts.update(after=kernel_snapshot(ctx.kernels), files_after=plan_files(ctx.plan_dir),
                  stats=numeric_delta(stats_before, plan_cache.stats()))
    for impl, times in ms.items():
        row[impl] = result_of(prepared[impl], times, counts if impl == "flexplan" else {})
    ref, fx = row.get("spconv", {}), row.get("flexplan", {})
    if "median_ms" in ref and "median_ms" in fx:
        row["speedup"] = ref["median_ms"] / fx["median_ms"]
        row["paired_speedup"] = statistics.median(
            s / f for s, f in zip(ref["ms"], fx["ms"]))
    return row


# ---------------------------------------------------------------- report

def cell_ms(result: dict | None) -> str:
    if result is None:
        return "-"
    if "error" in result:
        return "error"
    return f"{result['median_ms']:.1f} ({result['mean_ms']:.1f})"


def table_line(row: dict) -> str:
    fx = row.get("flexplan", {})
    comp = fx.get("timed_compiles")
    if comp is None:
        compiles = files = builds = "-"
    else:
        compiles = str(comp["compiles"])
        if comp["aot_loaded"]:
            compiles += f" (+{comp['aot_loaded']} AOT)"
        files = str(fx["plan_files_timed"])
        builds = str(fx["plan_stats_timed"].get("builds", 0))
    speedup = f"{row['speedup']:.2f}x" if "speedup" in row else "-"
    paired = f"{row['paired_speedup']:.2f}x" if "paired_speedup" in row else "-"
    return (f"| {row['network']} | {row['mode']} | {row['phase']} | {row['coords']} | "
            f"{row['voxels']} | {cell_ms(row.get('spconv'))} | {cell_ms(fx or None)} | {speedup} | "
            f"{paired} | {compiles} | {files} | {builds} |")


TABLE_HEAD = ["| network | mode | step | coords | voxels | spconv ms median (mean) | "
              "flexplan ms median (mean) | speedup | paired speedup | compiles | plan files | "
              "plan builds |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]


def header_lines(ctx: Context, versions: dict, date: str) -> list[str]:
    args, sizes = ctx.args, ctx.sizes
    grid = sizes.grid
    return [f"# End to end: flexplan vs spconv, LiDAR networks ({date})", "",
            f"{versions['gpu']}; torch {versions['torch']}, Triton {versions['triton']}, "
            f"spconv {versions['spconv']}; flexplan {versions['flexplan']}.",
            f"Host: {versions['host']}. AOT bundles found: {versions['aot_bundles']}.",
            f"Data: batch {args.batch} of ray-cast {sizes.scan.get('beams', 64)}-beam scans "
            f"({sizes.scenes} scenes), augmented and voxelized on {grid.voxel_size} m voxels, "
            f"sparse_shape {list(grid.sparse_shape)}; networks' base width {sizes.base}.",
            f"Steps: {args.warmup} warm-up, then {args.steps} timed; wall clock per step with "
            "torch.cuda.synchronize() around it. fresh: a new augmented batch every step (never "
            "repeated); same: one batch (the same tensors) every step.", ""]


NOTES = [
    "",
    "train: zero_grad, forward, loss, backward, SGD step (BatchNorm in training mode); infer: "
    "eval, torch.no_grad(), forward. Each implementation warms up on its own, then the two "
    "take turns step by step (step i of each, the order alternating), so both see the host's "
    "speed of the same seconds. Speedup: spconv median / flexplan median; paired speedup: the "
    "median over the timed steps of spconv ms / flexplan ms at the same step.",
    "compiles: Triton JIT compilations during flexplan's timed steps (new compile-cache entries "
    "of the flexplan.kernels_src kernels, less the binaries an AOT bundle handed to the JIT; "
    "a compile may be a load from Triton's own disk cache; +N AOT: bundle binaries loaded). "
    "plan files: .fxplan files written to the plan cache "
    "directory during the timed steps; plan builds: plans built in them "
    "(flexplan.plan_cache.stats()).",
]


def row_name(row: dict) -> str:
    return f"{row['network']} {row['mode']} {row['phase']} {row['coords']}"


def summary_lines(rows: list[dict], source: BatchSource, plan_dir: Path) -> list[str]:
    """Voxel counts, what compiled during timed steps (by row), what dtype the convolutions
    produced where autocast decides it, and the plan files left."""
    voxels = sorted(source.voxels)
    lines = [f"Voxels per batch over the {len(voxels)} batches generated: min {voxels[0]}, median "
             f"{voxels[len(voxels) // 2]}, max {voxels[-1]}.",
             f"Plan files in the plan cache directory at the end: {plan_files(plan_dir)}."]
    from flexplan.aot import runtime

    lines.append(f"Kernel binaries over the whole run: {runtime.stats['aot']} from AOT bundles "
                 f"({runtime.stats['direct']} of them launched directly), "
                 f"{runtime.stats['jit']} compiled by the JIT after a bundle miss.")
    compiled = [f"{row_name(r)}: " + ", ".join(r["flexplan"]["timed_compiles"]["kernels"])
                for r in rows if r.get("flexplan", {}).get("timed_compiles", {}).get("kernels")]
    lines.append("Kernels with new compiled variants during timed steps: " +
                 ("; ".join(compiled) if compiled else "none") + ".")
    dtypes = {f"{r['network']} {r['mode']}": " / ".join(r.get(i, {}).get("sparse_dtype", "-") for i in IMPLS)
              for r in rows if MODES[r["mode"]].autocast is not None}
    if dtypes:
        lines.append("Sparse features out of the last conv block under autocast (spconv / flexplan): " +
                     "; ".join(f"{k}: {v}" for k, v in dtypes.items()) + ".")
    return lines


def error_lines(rows: list[dict]) -> list[str]:
    errors = [f"- {row_name(r)}, {impl}: {r[impl]['error']}"
              for r in rows for impl in IMPLS if "error" in r.get(impl, {})]
    return ["Errors:"] + errors if errors else []


def write_results(lines: list[str], rows: list[dict], meta: dict, md_path: Path) -> None:
    md_path.parent.mkdir(parents=True, exist_ok=True)
    md_path.write_text("\n".join(lines) + "\n")
    with open(md_path.with_suffix(".jsonl"), "a") as fh:
        for row in rows:
            fh.write(json.dumps({**meta, **row}, default=str) + "\n")
    out_dir = os.environ.get("OUT")
    if out_dir:
        for path in (md_path, md_path.with_suffix(".jsonl")):
            with contextlib.suppress(OSError):
                Path(out_dir, path.name).write_bytes(path.read_bytes())


# ---------------------------------------------------------------- profile

def profile_train(ctx: Context, source: BatchSource, net_name: str, net_cls, state, mode: Mode) -> None:
    """torch.profiler tables of 5 fresh-coordinate train steps per implementation."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx.device.type == "cuda" else [])
    for impl, sp in ctx.namespaces.items():
        batches = source.take(3 + 5, mode.input_dtype)
        try:
            net = build_model(net_cls, sp, state, mode, ctx.sizes, ctx.device)
            step = train_step_fn(net, sp, mode, ctx.device)
            timed(step, batches[:3], ctx.device)  # warm: allocator, kernels
            with profile(activities=activities) as prof:
                ms = timed(step, batches[3:], ctx.device)
        except Exception as exc:
            print(f"profile {net_name} {mode.name} {impl}: {short_error(exc)}")
            continue
        averages = prof.key_averages()
        title = (f"profile: {net_name}, {mode.name}, {impl}, 5 fresh train steps "
                 f"({statistics.fmean(ms):.1f} ms mean)")
        for sort_by in ("cpu_time_total", "self_cpu_time_total") + (
                ("cuda_time_total",) if ctx.device.type == "cuda" else ()):
            print(f"\n=== {title}: top ops by {sort_by}")
            print(averages.table(sort_by=sort_by, row_limit=20, max_name_column_width=60))


# ---------------------------------------------------------------- main

def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=None, help="timed steps per run (30; --small: 2)")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up steps per run (10; --small: 1)")
    parser.add_argument("--networks", default="encoder,unet", help="comma list of encoder, unet")
    parser.add_argument("--modes", default="fp16", help=f"comma list of {', '.join(MODES)}")
    parser.add_argument("--phases", default="train,infer", help="comma list of train, infer")
    parser.add_argument("--coords", default="fresh,same", help="comma list of fresh, same")
    parser.add_argument("--batch", type=int, default=2, help="scans per batch")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-spconv", action="store_true", help="flexplan only (no spconv here)")
    parser.add_argument("--small", action="store_true",
                        help="tiny scans and narrow networks (CPU smoke under TRITON_INTERPRET=1)")
    parser.add_argument("--profile", action="store_true",
                        help="also torch.profiler tables of 5 fresh train steps per implementation")
    parser.add_argument("--out", default=None,
                        help=f"results file (default {RESULTS.relative_to(SCRIPTS.parent)}; "
                             "--small: none); the .jsonl next to it gets the rows appended")
    args = parser.parse_args(argv)
    args.steps = args.steps if args.steps is not None else (2 if args.small else 30)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.small else 10)
    args.networks = [n for n in args.networks.split(",") if n]
    args.modes = [m for m in args.modes.split(",") if m]
    args.phases = [p for p in args.phases.split(",") if p]
    args.coords = [c for c in args.coords.split(",") if c]
    for name, values, allowed in (("--modes", args.modes, MODES), ("--phases", args.phases, STEP_FNS),
                                  ("--coords", args.coords, ("fresh", "same"))):
        bad = [v for v in values if v not in allowed]
        if bad:
            parser.error(f"{name}: unknown {bad}; choose from {list(allowed)}")
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be >= 1 and --warmup >= 0")
    if args.out is None and not args.small:
        args.out = str(RESULTS)
    return args


def load_namespaces(no_spconv: bool) -> tuple[dict, str]:
    import flexplan.nn.spconv as sp_fx

    if no_spconv:
        return {"flexplan": sp_fx}, "not run"
    import spconv
    import spconv.pytorch as sp_ref

    return {"spconv": sp_ref, "flexplan": sp_fx}, getattr(spconv, "__version__", "?")


def versions_of(device, spconv_version: str) -> dict:
    import triton

    import flexplan
    from bench_common import host_launch_us
    from flexplan.aot.bundle import bundle_dirs

    if device.type == "cuda":
        gpu = f"GPU {torch.cuda.get_device_name(device)}"
        host = f"{host_launch_us():.1f} us per small torch launch"
    else:
        gpu, host = "CPU (Triton interpreter)", "n/a"
    bundles = [str(p) for p in bundle_dirs()]
    return dict(gpu=gpu, host=host, torch=torch.__version__, triton=triton.__version__,
                spconv=spconv_version, flexplan=f"{flexplan.__version__} ({git_commit()})",
                aot_bundles=", ".join(bundles) if bundles else "none (kernels JIT-compile)")


def main(argv=None) -> int:
    args = parse_args(argv)
    plan_dir = use_fresh_cache_root()  # before flexplan builds or launches anything
    from bench_common import today
    from e2e_networks import NETWORKS

    unknown = [n for n in args.networks if n not in NETWORKS]
    if unknown:
        print(f"unknown networks {unknown}; choose from {list(NETWORKS)}")
        return 2
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not args.small:
        print("no GPU here: run with --small (and TRITON_INTERPRET=1 --no-spconv) for a smoke test")
        return 2
    namespaces, spconv_version = load_namespaces(args.no_spconv)
    sizes = sizes_for(args.small)
    ctx = Context(args, sizes, device, namespaces, plan_dir, flexplan_jit_functions())
    versions = versions_of(device, spconv_version)
    date = today()
    lines = header_lines(ctx, versions, date)
    print("\n".join(lines), flush=True)
    print(f"plan cache directory: {plan_dir}; kernels watched for compilations: {len(ctx.kernels)}")

    source = BatchSource(args, sizes, device)
    rows, lines_table = [], list(TABLE_HEAD)
    print("\n".join(TABLE_HEAD), flush=True)
    for net_name in args.networks:
        net_cls = NETWORKS[net_name]
        # One set of fp32 weights per network: spconv's when it runs (the flexplan copy loads it).
        torch.manual_seed(0)
        owner = namespaces.get("spconv", namespaces["flexplan"])
        state = copy.deepcopy(net_cls(owner, base=sizes.base).to(device).state_dict())
        for mode_name in args.modes:
            mode = MODES[mode_name]
            for phase in args.phases:
                for coords in args.coords:
                    first = IMPLS[len(rows) % 2]  # alternate who goes first: drift cancels
                    row = run_row(ctx, source, net_name, net_cls, state, mode, phase, coords, first)
                    rows.append(row)
                    lines_table.append(table_line(row))
                    print(lines_table[-1], flush=True)
            if args.profile:
                profile_train(ctx, source, net_name, net_cls, state, mode)

    summary, errors = summary_lines(rows, source, plan_dir), error_lines(rows)
    lines += lines_table + NOTES + [""] + summary + ([""] + errors if errors else [])
    print("\n".join([""] + summary + errors), flush=True)
    if args.out:
        meta = dict(date=date, versions=versions, batch=args.batch, seed=args.seed, small=args.small)
        write_results(lines, rows, meta, Path(args.out))
        print(f"wrote {args.out} and {Path(args.out).with_suffix('.jsonl').name}")
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
