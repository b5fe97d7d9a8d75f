"""Sparse U-Net (examples/sparse_unet.py): flexplan vs spconv 2.3, same code, same weights.

One GPU run. The network is built twice from one class, with `spconv.pytorch` and with
`flexplan.nn.spconv`; the flexplan copy loads the spconv copy's state_dict unchanged.
Accuracy: outputs and gradients (input features + every parameter) of both, in fp32 and fp16,
against the flexplan network in float64 (itself tested against dense float64 convolutions),
as max |err| / max |ref|; the coordinates of every level must be equal as sets.
Speed: forward + backward step time (median ms, CUDA events), BatchNorm in training mode,
(a) the same coordinates every step (flexplan: plans from its in-memory cache; spconv rebuilds
its pairs every forward), (b) fresh coordinates every step (both build everything).
Writes scripts/results/bench_unet_spconv.md.

Usage: python scripts/bench_unet_spconv.py [--resolution 160] [--batch 2] [--base 32]
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
os.environ.setdefault("FLEXPLAN_CACHE_DIR", tempfile.mkdtemp(prefix="flexplan-unet-"))

import spconv  # noqa: E402
import spconv.pytorch as sp_ref  # noqa: E402
from sparse_unet import SparseUNet  # noqa: E402

import flexplan.nn.spconv as sp_fx  # noqa: E402
from flexplan.workloads import sphere_shell  # noqa: E402

from bench_common import today

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "bench_unet_spconv.md")
DATE = today()
IN_CH, OUT_CH = 4, 4


def rel_err(got, ref):
    return ((got.double() - ref.double()).abs().max() / ref.double().abs().max().clamp_min(1e-30)).item()


def run(net, sp, feats, coords, shape, batch, grad):
    """Forward + backward; returns (output tensor, grads of input feats and of each param)."""
    x_feats = feats.clone().requires_grad_(True)
    out = net(sp.SparseConvTensor(x_feats, coords, list(shape), batch))
    net.zero_grad(set_to_none=True)
    out.features.backward(grad.to(out.features.dtype))
    return out, [x_feats.grad] + [p.grad for p in net.parameters()]


def level_coords(net, sp, feats, coords, shape, batch):
    """Sorted coordinate keys of the three encoder levels."""
    x = sp.SparseConvTensor(feats, coords, list(shape), batch)
    e0 = net.enc0(x)
    e1 = net.enc1(e0)
    e2 = net.enc2(e1)
    out = []
    for t in (e0, e1, e2):
        c = t.indices.long()
        s = t.spatial_shape
        out.append(torch.sort(((c[:, 0] * s[0] + c[:, 1]) * s[1] + c[:, 2]) * s[2] + c[:, 3])[0])
    return out


def accuracy(ref_net, fx_net, feats, coords, shape, batch, lines):
    gen = torch.Generator(device="cuda").manual_seed(1)
    grad = torch.randn(coords.shape[0], OUT_CH, device="cuda", generator=gen, dtype=torch.float64)
    levels_ref = level_coords(ref_net, sp_ref, feats, coords, shape, batch)
    levels_fx = level_coords(fx_net, sp_fx, feats, coords, shape, batch)
    same = all(torch.equal(a, b) for a, b in zip(levels_ref, levels_fx))
    sizes = [len(a) for a in levels_fx]
    lines.append(f"Level voxel counts {sizes}; coordinate sets equal to spconv's: {same}")
    fx64 = copy.deepcopy(fx_net).double()
    for m in fx64.modules():  # float64 reference: torch gather + matmul over the same plans
        if hasattr(m, "algo"):
            m.algo = "explicit"
    out64, grads64 = run(fx64, sp_fx, feats.double(), coords, shape, batch, grad)
    lines += ["", "| dtype | impl | out rel err vs fp64 | worst input/weight grad rel err | same out coords |",
              "|---|---|---|---|---|"]
    for dname, dtype in (("fp32", torch.float32), ("fp16", torch.float16)):
        for name, net, sp in (("spconv", ref_net, sp_ref), ("flexplan", fx_net, sp_fx)):
            n = copy.deepcopy(net).to(dtype)
            out, grads = run(n, sp, feats.to(dtype), coords, shape, batch, grad)
            # Input and weight grads (conv biases feed BatchNorm: their true grad is 0).
            g = max(rel_err(a, b) for a, b in zip(grads, grads64) if a.dim() > 1)
            lines.append(f"| {dname} | {name} | {rel_err(out.features, out64.features):.2e} | "
                         f"{g:.2e} | {torch.equal(out.indices, out64.indices)} |")
            print(lines[-1], flush=True)
    return same


def conv1x1_check(lines):
    """spconv's kernel-1 path multiplies by weight.view(Ci, Co); record what it computes."""
    coords = sphere_shell(16, 1, device="cuda")
    feats = torch.randn(coords.shape[0], 3, device="cuda")
    ref = sp_ref.SubMConv3d(3, 5, 1, bias=False).cuda()
    out = ref(sp_ref.SparseConvTensor(feats, coords, [16] * 3, 1)).features
    w = ref.weight.detach()
    as_conv = feats @ w.reshape(5, 3).t()
    as_view = feats @ w.reshape(3, 5)
    lines.append(f"spconv SubMConv3d(kernel 1), weight {tuple(w.shape)}: rel err vs x @ W^T = "
                 f"{rel_err(out, as_conv):.1e}, vs x @ W.view(Ci, Co) = {rel_err(out, as_view):.1e}")
    print(lines[-1], flush=True)


def step_time(net, sp, feats, coord_sets, shape, batch, iters):
    """Median ms of forward + backward over `iters` steps, cycling through coord_sets."""
    times = []
    for i in range(iters + 3):
        coords = coord_sets[i % len(coord_sets)]
        f = feats[: coords.shape[0]].clone().requires_grad_(True)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = net(sp.SparseConvTensor(f, coords, list(shape), batch))
        out.features.float().square().mean().backward()
        end.record()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def plan_times(coords, shape, batch, lines):
    """Build times of the U-Net's plans at full resolution (ms, median of 5, cache bypassed)."""
    from triton.testing import do_bench

    from flexplan import ConvGeometry, build_plan
    from flexplan.planner.generative import inverse_plan
    from flexplan.sparse_tensor import check_coords

    down1 = ConvGeometry.make(3, stride=2, padding=1, submanifold=False)
    down2 = ConvGeometry.make(2, stride=2, submanifold=False)
    p1 = build_plan(coords, shape, batch, down1, check=False)
    cases = {
        "check_coords": lambda: check_coords(coords, shape, batch),
        "subm 3^3": lambda: build_plan(coords, shape, batch, ConvGeometry.make(3), check=False),
        "down 3^3/2": lambda: build_plan(coords, shape, batch, down1, check=False),
        "down 2^3/2 (level 1)": lambda: build_plan(p1.out_coords, p1.out_spatial_shape, batch,
                                                   down2, check=False),
        "inverse of down 3^3/2": lambda: inverse_plan(p1, coords),
    }
    ms = {k: do_bench(f, warmup=2, rep=20, return_mode="median") for k, f in cases.items()}
    lines.append("Plan build times at full resolution, ms: " +
                 ", ".join(f"{k} {v:.2f}" for k, v in ms.items()))
    print(lines[-1], flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--resolution", type=int, default=160)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--base", type=int, default=32)
    parser.add_argument("--iters", type=int, default=15)
    args = parser.parse_args(argv)
    r, batch = args.resolution, args.batch
    shape = (r, r, r)
    torch.manual_seed(0)
    coords = sphere_shell(r, batch, device="cuda")
    feats = torch.randn(coords.shape[0], IN_CH, device="cuda")
    ref_net = SparseUNet(sp_ref, IN_CH, OUT_CH, args.base).cuda()
    fx_net = SparseUNet(sp_fx, IN_CH, OUT_CH, args.base).cuda()
    fx_net.load_state_dict(ref_net.state_dict())  # spconv's state_dict, unchanged

    gpu = torch.cuda.get_device_name()
    lines = [f"# Sparse U-Net: flexplan vs spconv ({DATE})", "",
             f"GPU {gpu}; torch {torch.__version__}, Triton {triton.__version__}, "
             f"spconv {getattr(spconv, '__version__', '?')}.",
             f"Network: examples/sparse_unet.py, base {args.base} channels (32/64/128), "
             f"in {IN_CH} / out {OUT_CH}; input: sphere shell R={r}, batch {batch}, "
             f"{coords.shape[0]} voxels. The flexplan net loads the spconv net's state_dict.", ""]
    print("\n".join(lines), flush=True)
    same = accuracy(ref_net, fx_net, feats, coords, shape, batch, lines)
    lines.append("")
    conv1x1_check(lines)
    plan_times(coords, shape, batch, lines)

    # Fresh coordinates: random 90% subsets of the shell, a different one every step.
    gen = torch.Generator(device="cuda").manual_seed(2)
    fresh = [coords[torch.rand(coords.shape[0], device="cuda", generator=gen) < 0.9]
             for _ in range(args.iters + 3)]
    lines += ["", "Forward + backward step, median ms (BatchNorm in training mode):", "",
              "| dtype | coords | spconv | flexplan | speedup |", "|---|---|---|---|---|"]
    for dname, dtype in (("fp16", torch.float16), ("fp32", torch.float32)):
        nets = [(copy.deepcopy(ref_net).to(dtype), sp_ref), (copy.deepcopy(fx_net).to(dtype), sp_fx)]
        f = feats.to(dtype)
        for mode, sets in (("same", [coords]), ("fresh", fresh)):
            ms = [step_time(n, sp, f, sets, shape, batch, args.iters) for n, sp in nets]
            lines.append(f"| {dname} | {mode} | {ms[0]:.2f} | {ms[1]:.2f} | {ms[0] / ms[1]:.2f}x |")
            print(lines[-1], flush=True)
    lines += ["", "fp32: flexplan runs true fp32 (allow_tf32=False); spconv picks its own kernels.",
              "Relative errors are max |err| / max |ref| against the flexplan float64 network."]
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with open(RESULTS, "w") as fh:
        fh.write("\n".join(lines) + "\n")
    out_dir = os.environ.get("OUT")
    if out_dir:
        with open(os.path.join(out_dir, "bench_unet_spconv.md"), "w") as fh:
            fh.write("\n".join(lines) + "\n")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
