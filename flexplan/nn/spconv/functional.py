"""spconv.pytorch.functional's names that user code calls: `from flexplan.nn.spconv import
functional as Fsp` where the code had `from spconv.pytorch import functional as Fsp`."""
from ..spconv_modules import sparse_add

sparse_add_hash_based = sparse_add  # spconv's other name for it (misaligned inputs)

__all__ = ["sparse_add", "sparse_add_hash_based"]
