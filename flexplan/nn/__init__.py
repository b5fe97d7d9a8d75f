"""torch.nn modules over the flexplan ops."""
from .submconv import SubMConv3d

__all__ = ["SubMConv3d"]
