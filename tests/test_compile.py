"""torch.compile runs flexplan networks (the spconv drop-in namespace): the plan provider, the
coordinate check and the ops run eagerly behind graph breaks (flexplan/compile_boundary.py), the
torch code between them compiles; outputs and gradients equal eager ones. CPU: a small network
through AOTAutograd; GPU: the e2e U-Net through inductor."""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts"))

from e2e_networks import LidarUNet  # noqa: E402

import flexplan.nn.spconv as spconv  # noqa: E402
from flexplan.workloads import lidar_batch, lidar_scans, random_coords  # noqa: E402

SHAPE = (12, 10, 8)


def small_network():
    return spconv.SparseSequential(
        spconv.SubMConv3d(4, 8, 3), torch.nn.BatchNorm1d(8), torch.nn.ReLU(),
        spconv.SparseConv3d(8, 8, 3, 2, 1, indice_key="d"), spconv.SparseMaxPool3d(2, indice_key="p"),
        spconv.SparseInverseConv3d(8, 8, 2, indice_key="p"),
        spconv.SparseInverseConv3d(8, 4, 3, indice_key="d"))


def compare(net, compiled, make_input, tolerance):
    outs, grads = [], []
    for model in (net, compiled):
        x = make_input()
        out = model(x)
        out = out.features if isinstance(out, spconv.SparseConvTensor) else out
        out.float().square().sum().backward()
        outs.append(out.detach())
        grads.append([x.features.grad] + [p.grad.clone() for p in net.parameters()])
        net.zero_grad(set_to_none=True)
    torch.testing.assert_close(outs[1], outs[0], rtol=tolerance, atol=tolerance)
    for a, b in zip(grads[1], grads[0]):
        torch.testing.assert_close(a, b, rtol=tolerance, atol=tolerance)


def test_compiled_network_equals_eager(device):
    torch._dynamo.reset()
    torch.manual_seed(0)
    net = small_network().to(device).double()
    compiled = torch.compile(net, backend="aot_eager")  # AOTAutograd: the backward too
    for seed in (0, 1):  # new coordinates: plans are built outside the graphs
        coords = random_coords(60, SHAPE, 2, generator=torch.Generator().manual_seed(seed))
        feats = torch.randn(coords.shape[0], 4, dtype=torch.float64)
        compare(net, compiled, lambda: spconv.SparseConvTensor(
            feats.to(device).requires_grad_(), coords.to(device), SHAPE, 2), 1e-10)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_compiled_e2e_unet_equals_eager():
    torch._dynamo.reset()
    scans = lidar_scans(2, 0, "cuda")
    torch.manual_seed(0)
    net = LidarUNet(spconv).cuda()
    compiled = torch.compile(net)  # inductor
    for step in range(2):
        batch = lidar_batch(step, 2, 0, "cuda", scans=scans)
        compare(net, compiled, lambda: spconv.SparseConvTensor(
            batch.features.clone().requires_grad_(), batch.indices, list(batch.spatial_shape), 2),
            2e-3)
