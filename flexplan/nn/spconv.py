"""Drop-in namespace for spconv users: `import flexplan.nn.spconv as spconv` where the code had
`import spconv.pytorch as spconv`. Same names, constructors and weight layout (see
docs/migrating_from_spconv.md); here SubMConv3d is the spconv-compatible one."""
from .sparse_conv_tensor import IndiceData, SparseConvTensor
from .sparse_sequential import SparseSequential, ToDense
from .spconv_layers import (SparseConv3d, SparseConvolution, SparseConvTranspose3d,
                            SparseInverseConv3d, SparseModule, SubMConv3d)
from .spconv_pool import (SparseAvgPool, SparseAvgPool3d, SparseGlobalAvgPool,
                          SparseGlobalMaxPool, SparseMaxPool, SparseMaxPool3d)

__all__ = ["IndiceData", "SparseAvgPool", "SparseAvgPool3d", "SparseConv3d", "SparseConvTensor",
           "SparseConvTranspose3d", "SparseConvolution", "SparseGlobalAvgPool",
           "SparseGlobalMaxPool", "SparseInverseConv3d", "SparseMaxPool", "SparseMaxPool3d",
           "SparseModule", "SparseSequential", "SubMConv3d", "ToDense"]
