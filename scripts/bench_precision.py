"""Issue #21's ratios, measured against this host's noise: flexplan in fp16, amp-fp16, bf16 and
fp32 and spconv in fp16, amp-fp16 and fp32, taking turns step by step in one process.

bench_e2e.py runs each (mode, phase, coords) row once, minutes apart from the row it is compared
with; on hosts whose speed drifts +-30% between minutes, a 10% target cannot be read from that.
Here every run of one (network, phase, coords) cell has its own model and the runs take turns
step by step, so a ratio compares steps taken milliseconds apart.

Usage (GPU): python3 scripts/bench_precision.py [--steps 30] [--warmup 8]
             [--networks encoder,unet] [--phases train,infer] [--coords fresh,same]
             [--variants flexplan-fused] [--base flexplan/fp16,spconv/fp16]
Writes scripts/results/bench_precision.md.
"""
from __future__ import annotations

import argparse
import copy
import importlib
import os
import statistics
import sys
from pathlib import Path

import torch

SCRIPTS = Path(__file__).resolve().parent
sys.path.insert(0, str(SCRIPTS))

import bench_e2e as e2e  # noqa: E402
from flexplan.nn import fuse_conv_bn  # noqa: E402

RESULTS = SCRIPTS / "results" / "bench_precision.md"
BASE_RUNS = (("flexplan", "fp16"), ("flexplan", "amp-fp16"), ("flexplan", "bf16"),
             ("flexplan", "fp32"), ("spconv", "fp16"), ("spconv", "amp-fp16"), ("spconv", "fp32"))
# Variants: flexplan fp16 changed one way each. flexplan-fused: for inference, the model's
# eval-mode BatchNorms folded into their convs (flexplan.nn.fuse_conv_bn, opt-in).
# In-process A/B runs: module settings changed around each of the variant's steps.
# flexplan-synced-pairs: submanifold training builds sync to learn their pair count, as before
# they deferred it. flexplan-recorded-order: the step's prefetch builds its plans in the order
# the layers ask, as before strided plans went first.
VARIANTS = {"flexplan-fused": {"fuse": True},
            "flexplan-synced-pairs": {"settings": (("flexplan.planner", "DEFERRED_PAIRS_MAX", 0),)},
            "flexplan-recorded-order": {"settings": (("flexplan.plan_prefetch", "STRIDED_FIRST",
                                                      False),)},
            # without what torch.compile's custom ops add to eager calls: plans indexed by
            # their token (plan_tokens), the conv's is_compiling branch
            # strided / transposed plans' bwd maps scheduled (masked kernels for the strided
            # convs' grad-input and the inverse convs), as before sessions 37 (inference) and
            # 41 (training): planner.segments.SCHEDULE_BWD_MAPS
            "flexplan-scheduled-bwd-maps": {"settings": (
                ("flexplan.planner.segments", "SCHEDULE_BWD_MAPS", True),)},
            # submanifold inference plans scheduled at their first sighting, as before
            # (plan_cache.DEFER_FIRST_SCHEDULE)
            "flexplan-scheduled-first-sightings": {"settings": (
                ("flexplan.cache.plan_cache", "DEFER_FIRST_SCHEDULE", False),)},
            # eval conv -> BatchNorm -> ReLU blocks module by module, as before session 40
            # (nn/conv_epilogue.FUSE_BN_RELU: one kernel each)
            "flexplan-unfused-blocks": {"settings": (
                ("flexplan.nn.conv_epilogue", "FUSE_BN_RELU", False),)},
            # maps without a schedule through the implicit kernels, as before session 39
            "flexplan-implicit-unscheduled": {"settings": (
                ("flexplan.ops.conv", "FULL_SCHEDULES", False),)},
            # the conv op's host path at its floor: each part (forward, grad-input, grad-weight)
            # one allocation and one fill, no kernel of its own (what a conv op in C++ could
            # at best leave of the Python op's host time; its outputs are zeros)
            "flexplan-floor-conv": {"settings": (
                ("flexplan.nn.spconv_layers", "sparse_conv", lambda *a, **k: _floor_conv(*a, **k)),)},
            # launches hand Triton's launcher the tensors themselves (it calls data_ptr and
            # asks the driver about each address), as before session 42
            "flexplan-tensor-args": {"settings": (
                ("flexplan.launcher", "TENSORS_AS_ADDRESSES", False),)},
            # launch classes argument by argument, as before session 42
            "flexplan-generic-classes": {"settings": (
                ("flexplan.launcher", "GENERATED_CLASSES", False),)},
            # dispatch asked at every fresh map's first launches, and a pinned allocation per
            # pending pair count, as before session 43
            "flexplan-session42-host": {"settings": (
                ("flexplan.ops.conv", "KEEP_SHAPE_CONFIGS", False),
                ("flexplan.plan", "SHARED_PINNED_COUNTS", False))},
            # every launch through launcher's Python path (Triton's C launcher), as before
            # session 43's native launcher (flexplan/launch_native.py)
            "flexplan-python-launch": {"settings": (
                ("flexplan.launcher", "NATIVE_LAUNCHES", False),)},
            # grad-input over a transposed copy of the weight, as before session 46
            "flexplan-dgrad-weight-copy": {"settings": (
                ("flexplan.ops.conv", "DGRAD_WEIGHT_COPY", True),)},
            # every submanifold training build eager, as before session 47
            # (planner/build_graphs.py: replayed from CUDA graphs)
            "flexplan-eager-builds": {"settings": (
                ("flexplan.planner.build_graphs", "CAPTURE_BUILDS", False),)},
            # each build graph serves its own bucket only, as before session 48
            # (planner/graph_registry.ROOM: a kept graph of up to a third more rows serves)
            "flexplan-bucket-graphs": {"settings": (
                ("flexplan.planner.graph_registry", "ROOM", 1.0),)},
            "flexplan-no-graph-ops": {"settings": (
                ("flexplan.plan", "_register_token", lambda plan: None),
                ("flexplan.nn.spconv_layers", "sparse_conv",
                 importlib.import_module("flexplan.ops.conv")._eager_sparse_conv))}}
# (label with the bound, numerator run, denominator run): step-time ratios.
BASE_RATIOS = (
    ("flexplan amp-fp16 / fp16 (<= 1.10)", ("flexplan", "amp-fp16"), ("flexplan", "fp16")),
    ("flexplan bf16 / fp16 (<= 1.10)", ("flexplan", "bf16"), ("flexplan", "fp16")),
    ("spconv fp32 / flexplan fp32 (>= 1.2, train)", ("spconv", "fp32"), ("flexplan", "fp32")),
    ("spconv fp16 / flexplan fp16", ("spconv", "fp16"), ("flexplan", "fp16")),
    ("spconv amp / flexplan amp", ("spconv", "amp-fp16"), ("flexplan", "amp-fp16")),
)
# Each variant against flexplan fp16: (label, variant run, flexplan fp16 run).
_VARIANT_LABELS = {
    "flexplan-fused": "flexplan fused / flexplan fp16 (inference)",
    "flexplan-synced-pairs": "flexplan synced pairs / flexplan fp16 (training)",
    "flexplan-recorded-order": "flexplan recorded order / flexplan fp16",
    "flexplan-scheduled-bwd-maps": "flexplan scheduled bwd maps / flexplan fp16",
    "flexplan-scheduled-first-sightings": "flexplan scheduled first sightings / flexplan fp16",
    "flexplan-implicit-unscheduled": "flexplan implicit over unscheduled maps / flexplan fp16",
    "flexplan-unfused-blocks": "flexplan unfused blocks / flexplan fp16",
    "flexplan-floor-conv": "flexplan with a floor conv op / flexplan fp16",
    "flexplan-tensor-args": "flexplan tensor args / flexplan fp16",
    "flexplan-generic-classes": "flexplan generic classes / flexplan fp16",
    "flexplan-session42-host": "flexplan session 42's host path / flexplan fp16",
    "flexplan-python-launch": "flexplan Python launch path / flexplan fp16",
    "flexplan-no-graph-ops": "flexplan without graph-op costs / flexplan fp16",
    "flexplan-dgrad-weight-copy": "flexplan dgrad over a weight copy / flexplan fp16",
    "flexplan-eager-builds": "flexplan eager builds / flexplan fp16",
    "flexplan-bucket-graphs": "flexplan graphs per bucket / flexplan fp16",
}
VARIANT_RATIOS = {name: (label, (name, "fp16"), ("flexplan", "fp16"))
                  for name, label in _VARIANT_LABELS.items()}


class _FloorConv(torch.autograd.Function):
    """A conv's shapes at the least host cost: zeros out, zeros gradients."""

    @staticmethod
    def forward(ctx, feats, weight, bias, num_out):
        ctx.n_in, ctx.has_bias = feats.shape[0], bias is not None
        ctx.weight_shape = weight.shape
        return feats.new_zeros(num_out, weight.shape[0])

    @staticmethod
    def backward(ctx, grad_out):
        grad_bias = grad_out.new_zeros(ctx.weight_shape[0]) if ctx.has_bias else None
        return (grad_out.new_zeros(ctx.n_in, ctx.weight_shape[-1]),
                grad_out.new_zeros(ctx.weight_shape), grad_bias, None)


def _floor_conv(feats, plan, weight, bias=None, algo="auto", allow_tf32=False, bn_relu=None):
    if torch.is_grad_enabled():
        return _FloorConv.apply(feats, weight, bias, plan.num_out)
    return feats.new_zeros(plan.num_out, weight.shape[0])


def with_settings(step, settings):
    """step with each (module, attribute, value) of settings set during each call, restored
    after."""
    if not settings:
        return step
    targets = [(importlib.import_module(module), name, value) for module, name, value in settings]

    def run(*args, **kwargs):
        saved = [(module, name, getattr(module, name)) for module, name, _ in targets]
        for module, name, value in targets:
            setattr(module, name, value)
        try:
            return step(*args, **kwargs)
        finally:
            for module, name, value in saved:
                setattr(module, name, value)
    return run


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--networks", default="encoder,unet")
    p.add_argument("--phases", default="train,infer")
    p.add_argument("--coords", default="fresh,same")
    p.add_argument("--variants", default="flexplan-fused",
                   help="comma-separated flexplan fp16 variants to run too: " + ", ".join(VARIANTS))
    p.add_argument("--base", default=",".join(f"{i}/{m}" for i, m in BASE_RUNS),
                   help="comma-separated library/mode runs (default: all)")
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args()
    for name in ("networks", "phases", "coords", "variants"):
        setattr(args, name, [v for v in getattr(args, name).split(",") if v])
    args.batch, args.seed = 2, 0
    unknown = set(args.variants) - set(VARIANTS)
    if unknown:
        p.error(f"unknown variants {sorted(unknown)}; choose from {sorted(VARIANTS)}")
    base = tuple(tuple(r.split("/")) for r in args.base.split(",") if r)
    if set(base) - set(BASE_RUNS):
        p.error(f"unknown runs {sorted(set(base) - set(BASE_RUNS))}; choose from {BASE_RUNS}")
    args.runs = base + tuple((v, "fp16") for v in args.variants)
    args.ratios = BASE_RATIOS + tuple(VARIANT_RATIOS[v] for v in args.variants)
    return args


def paired(cell: dict, a, b) -> float | None:
    """Median over steps of a's step time / b's step time at the same step index (the two
    ran within milliseconds of each other, on this host's speed of that moment)."""
    if a not in cell or b not in cell:
        return None
    return statistics.median(x / y for x, y in zip(cell[a], cell[b]))


def run_cell(ctx, source, net_cls, state, phase: str, coords: str, args, errors: list) -> dict:
    """Every run of args.runs on its own model, step by step in turn: step i of each run, in an
    order rotated with i, then step i + 1. Fresh: each run has batches of its own (flexplan's
    runs must not find each other's plans); same: one batch for all. Returns run -> [ms]."""
    n = args.warmup + args.steps
    shared = source.take(1, torch.float32) * n if coords == "same" else None
    runs = {}
    for impl, mode_name in args.runs:
        mode = e2e.MODES[mode_name]
        base = shared if shared is not None else source.take(n, torch.float32)
        batches = [b._replace(features=b.features.to(mode.input_dtype)) for b in base]
        sp = ctx.namespaces["flexplan" if impl in VARIANTS else impl]
        try:
            net = e2e.build_model(net_cls, sp, state, mode, ctx.sizes, ctx.device)
            variant = VARIANTS.get(impl, {})
            if variant.get("fuse") and phase == "infer":
                fuse_conv_bn(net.eval())
            step = e2e.STEP_FNS[phase](net, sp, mode, ctx.device)
            step = with_settings(step, variant.get("settings", ()))
            e2e.timed(step, batches[:args.warmup], ctx.device)
        except Exception as exc:
            errors.append(f"{impl} {mode_name} {phase} {coords}: {e2e.short_error(exc)}")
            continue
        runs[(impl, mode_name)] = (step, batches[args.warmup:])
    before = e2e.kernel_snapshot(ctx.kernels)
    times = {run: [] for run in runs}
    order = list(runs)
    for i in range(args.steps):
        shift = i % len(order)
        for run in order[shift:] + order[:shift]:
            step, batches = runs[run]
            times[run].extend(e2e.timed(step, [batches[i]], ctx.device))
    delta = e2e.compile_delta(before, e2e.kernel_snapshot(ctx.kernels))
    if delta["compiles"]:
        errors.append(f"{phase} {coords}: {delta['compiles']} flexplan compilations in timed "
                      f"steps ({', '.join(delta['kernels'])})")
    return times


def main() -> int:
    args = parse_args()
    plan_dir = e2e.use_fresh_cache_root()
    from bench_common import today
    from e2e_networks import NETWORKS

    device = torch.device("cuda")
    namespaces, spconv_version = e2e.load_namespaces(False)
    sizes = e2e.sizes_for(False)
    ctx = e2e.Context(args, sizes, device, namespaces, plan_dir, e2e.flexplan_jit_functions())
    versions = e2e.versions_of(device, spconv_version)
    source = e2e.BatchSource(args, sizes, device)
    cells: dict = {}  # (network, phase, coords) -> run -> [ms per step]
    errors: list[str] = []
    for net_name in args.networks:
        net_cls = NETWORKS[net_name]
        torch.manual_seed(0)
        state = copy.deepcopy(net_cls(namespaces["spconv"], base=sizes.base).to(device).state_dict())
        for phase in args.phases:
            for coords in args.coords:
                cell = run_cell(ctx, source, net_cls, state, phase, coords, args, errors)
                cells[(net_name, phase, coords)] = cell
                print(f"{net_name} {phase} {coords}: " + ", ".join(
                    f"{i}/{m} {statistics.median(v):.1f}" for (i, m), v in cell.items()), flush=True)

    lines = [f"# Precision modes side by side: flexplan vs spconv, step by step in turn ({today()})", "",
             f"{versions['gpu']}; torch {versions['torch']}, Triton {versions['triton']}, spconv "
             f"{versions['spconv']}; flexplan {versions['flexplan']}. Host: {versions['host']}. "
             f"AOT bundles: {versions['aot_bundles']}.",
             f"bench_e2e's networks and LiDAR batches (2 scans, ~110k voxels). Each run (library, "
             f"mode) has its own model; after {args.warmup} warm-up steps each, the runs take "
             f"turns step by step ({args.steps} steps each, the order rotated every step), so all "
             "see the host's speed of the same seconds. fresh: every run its own new batches; "
             "same: one batch for all. Cells: median ms (p25-p75).", "",
             "| network | step | coords | " + " | ".join(f"{i} {m}" for i, m in args.runs) + " |",
             "|---|---|---|" + "---|" * len(args.runs)]
    for (net, phase, coords), cell in cells.items():
        row = []
        for run in args.runs:
            v = sorted(cell.get(run, []))
            row.append(f"{statistics.median(v):.1f} ({v[len(v) // 4]:.1f}-{v[3 * len(v) // 4]:.1f})"
                       if v else "-")
        lines.append(f"| {net} | {phase} | {coords} | " + " | ".join(row) + " |")
    lines += ["", "Ratios: median over steps of the two runs' step-time ratio at the same step.", "",
              "| network | step | coords | " + " | ".join(r[0] for r in args.ratios) + " |",
              "|---|---|---|" + "---|" * len(args.ratios)]
    for (net, phase, coords), cell in cells.items():
        vals = [paired(cell, a, b) for _, a, b in args.ratios]
        lines.append(f"| {net} | {phase} | {coords} | " +
                     " | ".join("-" if v is None else f"{v:.2f}" for v in vals) + " |")
    lines += ["", "Errors and compilations in timed steps: " + ("; ".join(errors) if errors else "none")]
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.out).write_text(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], Path(args.out).name).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
