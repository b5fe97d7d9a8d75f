"""A small sparse U-Net (submanifold convs, strided downsampling, inverse-conv upsampling, skip
connections) trained for a few steps to denoise synthetic sphere shells.

The network is written against the spconv API and built from a namespace argument, so the
same code runs on flexplan (`import flexplan.nn.spconv as spconv`) and on spconv itself
(`import spconv.pytorch as spconv`; scripts/bench_unet_spconv.py does both).

    python examples/sparse_unet.py                        # GPU if there is one
    TRITON_INTERPRET=1 python examples/sparse_unet.py --tiny   # CPU, Triton interpreter
"""
from __future__ import annotations

import argparse
import time

import torch

import flexplan.nn.spconv as flexplan_spconv
from flexplan.workloads import sphere_shell


def block(sp, conv, channels):
    return sp.SparseSequential(conv, torch.nn.BatchNorm1d(channels), torch.nn.ReLU())


class SparseUNet(torch.nn.Module):
    """Two levels: 3^3 stride-2 then 2^3 stride-2 downsampling; inverse convs go back up onto
    exactly the coordinates of each level, where the encoder features are concatenated."""

    def __init__(self, sp, in_channels: int, out_channels: int, base: int = 16):
        super().__init__()
        c1, c2, c3 = base, 2 * base, 4 * base
        self.enc0 = block(sp, sp.SubMConv3d(in_channels, c1, 3, indice_key="subm0"), c1)
        self.enc1 = sp.SparseSequential(
            block(sp, sp.SparseConv3d(c1, c2, 3, stride=2, padding=1, indice_key="down1"), c2),
            block(sp, sp.SubMConv3d(c2, c2, 3, indice_key="subm1"), c2))
        self.enc2 = sp.SparseSequential(
            block(sp, sp.SparseConv3d(c2, c3, 2, stride=2, indice_key="down2"), c3),
            block(sp, sp.SubMConv3d(c3, c3, 3, indice_key="subm2"), c3))
        self.up2 = block(sp, sp.SparseInverseConv3d(c3, c2, 2, indice_key="down2"), c2)
        self.dec1 = block(sp, sp.SubMConv3d(2 * c2, c2, 3, indice_key="subm1"), c2)
        self.up1 = block(sp, sp.SparseInverseConv3d(c2, c1, 3, indice_key="down1"), c1)
        self.dec0 = block(sp, sp.SubMConv3d(2 * c1, c1, 3, indice_key="subm0"), c1)
        self.head = torch.nn.Linear(c1, out_channels)

    def forward(self, x):
        e0 = self.enc0(x)
        e1 = self.enc1(e0)
        e2 = self.enc2(e1)
        d1 = self.up2(e2)
        d1 = self.dec1(d1.replace_feature(torch.cat([d1.features, e1.features], 1)))
        d0 = self.up1(d1)
        d0 = self.dec0(d0.replace_feature(torch.cat([d0.features, e0.features], 1)))
        return d0.replace_feature(self.head(d0.features))


def synthetic_batch(sp, resolution: int, batch_size: int, device, generator):
    """Noisy positions of shell voxels (features) -> their clean offset from the grid centre."""
    coords = sphere_shell(resolution, batch_size, device=device)
    centre = (resolution - 1) / 2
    target = (coords[:, 1:].to(torch.float32) - centre) / resolution
    noise = torch.randn(target.shape, generator=generator).to(device) * 0.05
    x = sp.SparseConvTensor(target + noise, coords, (resolution,) * 3, batch_size)
    return x, target


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="8^3 grid, 2 steps (CPU interpreter)")
    parser.add_argument("--steps", type=int, default=None)
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolution, base, steps = (8, 4, 2) if args.tiny else (64, 16, 20)
    steps = args.steps or steps
    torch.manual_seed(0)
    net = SparseUNet(flexplan_spconv, 3, 3, base).to(device)
    opt = torch.optim.Adam(net.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    for step in range(steps):
        start = time.perf_counter()
        x, target = synthetic_batch(flexplan_spconv, resolution, 2, device, gen)
        loss = torch.nn.functional.mse_loss(net(x).features, target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"step {step:3d}  loss {loss.item():.5f}  {1e3 * (time.perf_counter() - start):.0f} ms"
              f"  ({x.num_voxels} voxels)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
