"""Drop-in namespace for spconv users: `import flexplan.nn.spconv as spconv` where the code had
`import spconv.pytorch as spconv`. Same names, constructors and weight layout (see
docs/migrating_from_spconv.md); here SubMConv3d is the spconv-compatible one. A package, as
spconv.pytorch is: `from flexplan.nn.spconv.utils import PointToVoxel` and
`flexplan.nn.spconv.functional` / `.ops` import as spconv's do."""
from ..sparse_conv_tensor import IndiceData, SparseConvTensor
from ..sparse_sequential import SparseSequential, ToDense
from ..spconv_layers import (SparseConv1d, SparseConv2d, SparseConv3d, SparseConvolution,
                            SparseConvTranspose1d, SparseConvTranspose2d, SparseConvTranspose3d,
                            SparseInverseConv1d, SparseInverseConv2d, SparseInverseConv3d,
                            SparseModule, SubMConv1d, SubMConv2d, SubMConv3d)
from ..spconv_layers4d import (SparseAvgPool4d, SparseConv4d, SparseConvTranspose4d,
                              SparseInverseConv4d, SparseMaxPool4d, SubMConv4d)
from . import functional, ops, utils
from ..spconv_modules import (AddTable, AddTableMisaligned, ConcatTable, ConvAlgo, Identity,
                             JoinTable, RemoveGrid, SparseBatchNorm, SparseIdentity, SparseReLU,
                             SparseSyncBatchNorm, assign_name_for_sparse_modules)
from ..spconv_pool import (SparseAvgPool, SparseAvgPool1d, SparseAvgPool2d, SparseAvgPool3d,
                          SparseGlobalAvgPool, SparseGlobalMaxPool, SparseMaxPool, SparseMaxPool1d,
                          SparseMaxPool2d, SparseMaxPool3d)

__all__ = ["AddTable", "AddTableMisaligned", "ConcatTable", "ConvAlgo", "Identity", "JoinTable",
           "RemoveGrid", "SparseBatchNorm", "SparseIdentity", "SparseReLU", "SparseSyncBatchNorm",
           "assign_name_for_sparse_modules", "functional", "IndiceData", "SparseAvgPool1d",
           "SparseConv1d", "SparseConvTranspose1d", "SparseInverseConv1d", "SparseMaxPool1d",
           "SubMConv1d", "SparseAvgPool", "SparseAvgPool2d", "SparseAvgPool3d", "SparseConv2d",
           "SparseConvTranspose2d", "SparseInverseConv2d", "SparseMaxPool2d", "SubMConv2d", "SparseConv3d", "SparseConvTensor",
           "SparseConvTranspose3d", "SparseConvolution", "SparseGlobalAvgPool",
           "SparseGlobalMaxPool", "SparseInverseConv3d", "SparseMaxPool", "SparseMaxPool3d",
           "SparseModule", "SparseSequential", "SubMConv3d", "ToDense", "ops", "utils",
           "SparseAvgPool4d", "SparseConv4d", "SparseConvTranspose4d", "SparseInverseConv4d",
           "SparseMaxPool4d", "SubMConv4d"]
