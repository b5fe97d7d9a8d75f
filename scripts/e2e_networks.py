"""The two networks of scripts/bench_e2e.py, written once against an spconv namespace `sp`:
`spconv.pytorch` or `flexplan.nn.spconv`. Same module tree either way, so the flexplan copy
loads the spconv copy's state_dict unchanged.

- VoxelResBackBone8x: OpenPCDet's 3D encoder of CenterPoint / PV-RCNN++ on Waymo
  (pcdet/models/backbones_3d/spconv_backbone.py), then `.dense()` to the BEV map.
- LidarUNet: a 4-level sparse U-Net (16/32/64/128 channels) with SparseInverseConv3d decoders
  and concatenated skips, giving per-voxel class logits (a LiDAR segmentation network).

Inputs: a SparseConvTensor with indices (batch, z, y, x) on the grid of
flexplan.workloads.VoxelGrid.sparse_shape (Z + 1, Y, X), e.g. (41, 1504, 1504).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn


def norm(channels: int) -> nn.BatchNorm1d:
    """OpenPCDet's norm_fn."""
    return nn.BatchNorm1d(channels, eps=1e-3, momentum=0.01)


def post_act_block(sp, cin: int, cout: int, kernel_size, indice_key: str, stride=1, padding=0,
                   conv_type: str = "subm"):
    """OpenPCDet's post_act_block: an unbiased conv, BatchNorm, ReLU."""
    if conv_type == "subm":
        conv = sp.SubMConv3d(cin, cout, kernel_size, bias=False, indice_key=indice_key)
    elif conv_type == "spconv":
        conv = sp.SparseConv3d(cin, cout, kernel_size, stride=stride, padding=padding, bias=False,
                               indice_key=indice_key)
    elif conv_type == "inverseconv":
        conv = sp.SparseInverseConv3d(cin, cout, kernel_size, indice_key=indice_key, bias=False)
    else:
        raise ValueError(f"unknown conv_type {conv_type!r}")
    return sp.SparseSequential(conv, norm(cout), nn.ReLU())


@functools.lru_cache(maxsize=None)
def basic_block_class(sp):
    """OpenPCDet's SparseBasicBlock for namespace `sp`. It must subclass sp.SparseModule: that
    is how SparseSequential (both libraries) knows to hand it the sparse tensor itself."""

    class SparseBasicBlock(sp.SparseModule):
        """Two biased 3x3x3 submanifold convs with BatchNorm, a residual add, ReLU."""

        def __init__(self, channels: int, indice_key: str):
            super().__init__()
            # OpenPCDet passes bias = (norm_fn is not None) = True, and padding=1.
            self.conv1 = sp.SubMConv3d(channels, channels, 3, stride=1, padding=1, bias=True,
                                       indice_key=indice_key)
            self.bn1 = norm(channels)
            self.relu = nn.ReLU()
            self.conv2 = sp.SubMConv3d(channels, channels, 3, stride=1, padding=1, bias=True,
                                       indice_key=indice_key)
            self.bn2 = norm(channels)

        def forward(self, x):
            identity = x
            out = self.conv1(x)
            out = out.replace_feature(self.relu(self.bn1(out.features)))
            out = self.conv2(out)
            out = out.replace_feature(self.bn2(out.features))
            return out.replace_feature(self.relu(out.features + identity.features))

    return SparseBasicBlock


class VoxelResBackBone8x(nn.Module):
    """OpenPCDet's VoxelResBackBone8x (8x downsampling in x/y, to 2 slices in z), then the
    dense BEV map [B, 128 * 2, Y / 8, X / 8] that a detection head would read. base: the first
    level's channels (OpenPCDet: 16; smaller only for interpreter tests)."""

    def __init__(self, sp, input_channels: int = 4, base: int = 16):
        super().__init__()
        block = functools.partial(post_act_block, sp)
        res = basic_block_class(sp)
        c1, c2, c3, c4 = base, 2 * base, 4 * base, 8 * base  # OpenPCDet: 16, 32, 64, 128
        self.conv_input = sp.SparseSequential(
            sp.SubMConv3d(input_channels, c1, 3, padding=1, bias=False, indice_key="subm1"),
            norm(c1), nn.ReLU())
        self.conv1 = sp.SparseSequential(res(c1, "res1"), res(c1, "res1"))
        self.conv2 = sp.SparseSequential(
            block(c1, c2, 3, "spconv2", stride=2, padding=1, conv_type="spconv"),
            res(c2, "res2"), res(c2, "res2"))
        self.conv3 = sp.SparseSequential(
            block(c2, c3, 3, "spconv3", stride=2, padding=1, conv_type="spconv"),
            res(c3, "res3"), res(c3, "res3"))
        self.conv4 = sp.SparseSequential(
            block(c3, c4, 3, "spconv4", stride=2, padding=(0, 1, 1), conv_type="spconv"),
            res(c4, "res4"), res(c4, "res4"))
        self.conv_out = sp.SparseSequential(
            sp.SparseConv3d(c4, c4, (3, 1, 1), stride=(2, 1, 1), padding=0, bias=False,
                            indice_key="spconv_down2"),
            norm(c4), nn.ReLU())
        self.last_sparse_dtype = None  # what the convs ran in (autocast may change it)

    def forward(self, x):
        x = self.conv_input(x)
        x = self.conv4(self.conv3(self.conv2(self.conv1(x))))
        out = self.conv_out(x)
        self.last_sparse_dtype = out.features.dtype
        dense = out.dense()  # [B, C, Z, Y, X]
        b, c, z, y, x_ = dense.shape
        return dense.view(b, c * z, y, x_)  # OpenPCDet's HeightCompression

    @staticmethod
    def loss(out: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """A stand-in for a detection head's loss: it reaches every BEV cell, hence every voxel."""
        return out.float().square().mean()


class LidarUNet(nn.Module):
    """Encoder: SubMConv 16, then three stride-2 SparseConv3d levels (32, 64, 128; the last
    with z padding 0, as VoxelBackBone8x). Decoder: SparseInverseConv3d back onto each level's
    coordinates, concatenated with that level's encoder features, a SubMConv3d to merge; a
    Linear head gives per-voxel logits. base: the first level's channels (16)."""

    def __init__(self, sp, input_channels: int = 4, num_classes: int = 4, base: int = 16):
        super().__init__()
        block = functools.partial(post_act_block, sp)
        c1, c2, c3, c4 = base, 2 * base, 4 * base, 8 * base  # 16, 32, 64, 128
        self.conv_input = block(input_channels, c1, 3, "subm1")
        self.conv1 = block(c1, c1, 3, "subm1")
        self.conv2 = sp.SparseSequential(
            block(c1, c2, 3, "spconv2", stride=2, padding=1, conv_type="spconv"),
            block(c2, c2, 3, "subm2"))
        self.conv3 = sp.SparseSequential(
            block(c2, c3, 3, "spconv3", stride=2, padding=1, conv_type="spconv"),
            block(c3, c3, 3, "subm3"))
        self.conv4 = sp.SparseSequential(
            block(c3, c4, 3, "spconv4", stride=2, padding=(0, 1, 1), conv_type="spconv"),
            block(c4, c4, 3, "subm4"))
        self.up4 = block(c4, c3, 3, "spconv4", conv_type="inverseconv")
        self.merge3 = block(2 * c3, c3, 3, "subm3")
        self.up3 = block(c3, c2, 3, "spconv3", conv_type="inverseconv")
        self.merge2 = block(2 * c2, c2, 3, "subm2")
        self.up2 = block(c2, c1, 3, "spconv2", conv_type="inverseconv")
        self.merge1 = block(2 * c1, c1, 3, "subm1")
        self.head = nn.Linear(c1, num_classes)
        self.last_sparse_dtype = None

    @staticmethod
    def _skip(up, lateral):
        """Concatenate an upsampled tensor with the encoder features of the same coordinates."""
        return up.replace_feature(torch.cat([up.features, lateral.features], 1))

    def forward(self, x):
        x1 = self.conv1(self.conv_input(x))
        x2 = self.conv2(x1)
        x3 = self.conv3(x2)
        x4 = self.conv4(x3)
        d3 = self.merge3(self._skip(self.up4(x4), x3))
        d2 = self.merge2(self._skip(self.up3(d3), x2))
        d1 = self.merge1(self._skip(self.up2(d2), x1))
        self.last_sparse_dtype = d1.features.dtype
        return self.head(d1.features)  # [N, num_classes], rows in the input's order

    @staticmethod
    def loss(out: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.float(), labels)


NETWORKS = {"encoder": VoxelResBackBone8x, "unet": LidarUNet}
