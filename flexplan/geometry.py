"""Convolution geometry: the shape facts a plan depends on, normalized to 3-tuples."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Union

IntOr3 = Union[int, Sequence[int]]


def triple(value: IntOr3, name: str) -> tuple[int, int, int]:
    """Expand an int or a 3-sequence to a tuple of three ints, with a clear error otherwise."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int or a sequence of 3 ints, got {value!r}")
    if isinstance(value, int):
        return (value, value, value)
    values = tuple(int(v) for v in value)
    if len(values) != 3:
        raise ValueError(f"{name} must have 3 entries (x, y, z), got {tuple(value)!r}")
    return values  # type: ignore[return-value]


@dataclass(frozen=True)
class ConvGeometry:
    kernel_size: tuple[int, int, int]
    dilation: tuple[int, int, int] = (1, 1, 1)
    stride: tuple[int, int, int] = (1, 1, 1)
    padding: tuple[int, int, int] = (0, 0, 0)
    submanifold: bool = True
    transposed: bool = False

    @classmethod
    def make(cls, kernel_size: IntOr3, dilation: IntOr3 = 1, stride: IntOr3 = 1,
             padding: IntOr3 = 0, submanifold: bool = True, transposed: bool = False) -> "ConvGeometry":
        geom = cls(triple(kernel_size, "kernel_size"), triple(dilation, "dilation"),
                   triple(stride, "stride"), triple(padding, "padding"),
                   bool(submanifold), bool(transposed))
        geom.validate()
        return geom

    @classmethod
    def submanifold_conv(cls, kernel_size: IntOr3, dilation: IntOr3 = 1) -> "ConvGeometry":
        return cls.make(kernel_size, dilation)

    def validate(self) -> None:
        if any(k < 1 for k in self.kernel_size):
            raise ValueError(f"kernel_size must be >= 1, got {self.kernel_size}")
        if any(d < 1 for d in self.dilation):
            raise ValueError(f"dilation must be >= 1, got {self.dilation}")
        if any(s < 1 for s in self.stride):
            raise ValueError(f"stride must be >= 1, got {self.stride}")
        if any(p < 0 for p in self.padding):
            raise ValueError(f"padding must be >= 0, got {self.padding}")
        if self.submanifold:
            if any(k % 2 == 0 for k in self.kernel_size):
                raise ValueError(f"submanifold convolution needs odd kernel sizes, got {self.kernel_size}")
            if self.stride != (1, 1, 1) or self.transposed:
                raise ValueError("submanifold convolution has stride 1 and is not transposed")

    @property
    def volume(self) -> int:
        kx, ky, kz = self.kernel_size
        return kx * ky * kz
