"""torch.nn modules over the flexplan ops."""
from .submconv import SubMConv3d

__all__ = ["SubMConv3d"]
from . import spconv  # spconv-compatible namespace (its SubMConv3d takes spconv's arguments)
from .sparse_conv_tensor import SparseConvTensor
from .sparse_sequential import SparseSequential, ToDense
from .spconv_layers import SparseConv3d, SparseConvTranspose3d, SparseInverseConv3d, SparseModule
from .sync_batchnorm import SyncBatchNorm, convert_sync_batchnorm  # no host syncs (issue #26)
from .eval_fusion import FoldedBatchNorm, fuse_conv_bn  # inference: BatchNorm into the conv

__all__ += ["SparseConv3d", "SparseConvTensor", "SparseConvTranspose3d", "SparseInverseConv3d",
            "SparseModule", "SparseSequential", "SyncBatchNorm", "ToDense",
            "convert_sync_batchnorm", "spconv", "FoldedBatchNorm", "fuse_conv_bn"]
