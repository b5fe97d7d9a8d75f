"""flexplan end to end: a small SubMConv3d network on a sphere shell, forward + backward,
checked against a float64 torch reference; on a GPU also timed at a real size.

Without a GPU the kernels run through Triton's interpreter at a tiny size.
"""
from __future__ import annotations

import os
import sys
import time

import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any Triton kernel is defined

from flexplan import SparseTensor, tensor_plan  # noqa: E402
from flexplan.nn import SubMConv3d  # noqa: E402
from flexplan.plan import MISSING  # noqa: E402
from flexplan.workloads import sphere_shell  # noqa: E402

CHANNELS = (4, 32, 32, 8)


def network(device, dtype):
    torch.manual_seed(0)
    layers = [SubMConv3d(a, b, 3) for a, b in zip(CHANNELS[:-1], CHANNELS[1:])]
    return torch.nn.ModuleList(layers).to(device=device, dtype=dtype)


def run(net, x: SparseTensor) -> SparseTensor:
    for i, layer in enumerate(net):
        x = layer(x)
        if i + 1 < len(net):
            x = x.replace_feats(torch.relu(x.feats))
    return x


def reference(net, x: SparseTensor):
    """The same network in float64 with plain torch: per offset, gather rows and matmul."""
    nmap = next(iter(x._plans.values())).fwd.neighbor_map
    feats = x.feats.double()
    params = []
    for i, layer in enumerate(net):
        w = layer.weight.detach().double().requires_grad_()
        b = layer.bias.detach().double().requires_grad_()
        params += [w, b]
        w = w.reshape(w.shape[0], -1, w.shape[-1])
        out = b.expand(feats.shape[0], -1).clone()
        for v in range(nmap.shape[1]):
            rows = (nmap[:, v] != MISSING).nonzero()[:, 0]
            out = out.index_add(0, rows, feats[nmap[rows, v].long()] @ w[:, v].t())
        feats = torch.relu(out) if i + 1 < len(net) else out
    return feats, params


def check(resolution, device):
    coords = sphere_shell(resolution, 1, device)
    x = SparseTensor(torch.randn(coords.shape[0], CHANNELS[0], device=device), coords,
                     (resolution,) * 3)
    net = network(device, torch.float32)
    y = run(net, x)
    target = torch.randn_like(y.feats)
    (y.feats * target).sum().backward()
    ref, ref_params = reference(net, x)
    (ref * target.double()).sum().backward()
    worst = 0.0
    got = [y.feats] + [p.grad for p in net.parameters()]
    want = [ref] + [p.grad for p in ref_params]
    for g, r in zip(got, want):
        g, r = g.detach().double(), r.detach()
        worst = max(worst, float((g - r).abs().max() / r.abs().max()))
    print(f"R={resolution}: {coords.shape[0]} voxels, {len(net)} layers "
          f"{' -> '.join(map(str, CHANNELS))}; plans built: {len(x._plans)}; "
          f"max relative error of output and all gradients vs float64: {worst:.2e}")
    if worst > 1e-4:
        print("MISMATCH against the float64 reference")
        return False
    return True


def timings(resolution, channels):
    from triton.testing import do_bench

    coords = sphere_shell(resolution, 1, "cuda")
    feats = torch.randn(coords.shape[0], channels, device="cuda", dtype=torch.float16)
    t0 = time.perf_counter()
    x = SparseTensor(feats, coords, (resolution,) * 3)
    tensor_plan(x, SubMConv3d(channels, channels, 3).geometry)
    torch.cuda.synchronize()
    plan_ms = (time.perf_counter() - t0) * 1e3
    torch.manual_seed(0)
    net = torch.nn.ModuleList(SubMConv3d(channels, channels, 3) for _ in range(4))
    net = net.to("cuda", torch.float16)
    fwd = do_bench(lambda: run(net, x), return_mode="median")
    xg = x.replace_feats(feats.clone().requires_grad_())
    fb = do_bench(lambda: run(net, xg).feats.float().square().mean().backward(),
                  return_mode="median")
    print(f"GPU {torch.cuda.get_device_name()}: R={resolution} ({coords.shape[0]} voxels), "
          f"4 x SubMConv3d({channels}, {channels}, 3) fp16: plan {plan_ms:.1f} ms (once), "
          f"forward {fwd:.2f} ms, forward+backward {fb:.2f} ms")


def main() -> int:
    device = torch.device("cuda" if ON_GPU else "cpu")
    ok = check(64 if ON_GPU else 8, device)
    if ON_GPU:
        timings(256, 64)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
