"""4D convolution geometry (spconv's SubMConv4d, SparseConv4d, ...): ConvGeometry's facts over
four spatial axes (d0..d3, spconv's (t, z, y, x)), normalized to 4-tuples.

A type of its own, never equal to a 3D ConvGeometry: a 4D plan can then never be taken for a
3D one (plans are kept by geometry), nor a 4D geometry handed to the 3D planner or its cache,
which serve 3D geometries only. Its fields carry ConvGeometry's names, so the code that reads
only those (plan.geometry.volume / .kernel_size / .transposed in the ops, inverse plans,
kernel_offsets, output_spatial_shape) serves both.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence, Union

IntOr4 = Union[int, Sequence[int]]


def quad(value: IntOr4, name: str) -> tuple[int, int, int, int]:
    """An int or a 4-sequence as a tuple of four ints, with a clear error otherwise."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int or a sequence of 4 ints, got {value!r}")
    if isinstance(value, int):
        return (value,) * 4
    values = tuple(int(v) for v in value)
    if len(values) != 4:
        raise ValueError(f"{name} of a 4D layer needs 4 entries, got {tuple(value)!r}")
    return values  # type: ignore[return-value]


@dataclass(frozen=True)
class ConvGeometry4d:
    kernel_size: tuple[int, int, int, int]
    dilation: tuple[int, int, int, int] = (1, 1, 1, 1)
    stride: tuple[int, int, int, int] = (1, 1, 1, 1)
    padding: tuple[int, int, int, int] = (0, 0, 0, 0)
    submanifold: bool = True
    transposed: bool = False

    @classmethod
    def make(cls, kernel_size: IntOr4, dilation: IntOr4 = 1, stride: IntOr4 = 1,
             padding: IntOr4 = 0, submanifold: bool = True,
             transposed: bool = False) -> "ConvGeometry4d":
        geom = cls(quad(kernel_size, "kernel_size"), quad(dilation, "dilation"),
                   quad(stride, "stride"), quad(padding, "padding"), bool(submanifold),
                   bool(transposed))
        geom.validate()
        return geom

    def validate(self) -> None:
        """ConvGeometry.validate's rules, per axis."""
        for name, values, least in (("kernel_size", self.kernel_size, 1),
                                    ("dilation", self.dilation, 1), ("stride", self.stride, 1),
                                    ("padding", self.padding, 0)):
            if any(v < least for v in values):
                raise ValueError(f"{name} must be >= {least}, got {values}")
        if self.submanifold:
            if any(k % 2 == 0 for k in self.kernel_size):
                raise ValueError(f"submanifold convolution needs odd kernel sizes, got "
                                 f"{self.kernel_size}")
            if self.stride != (1, 1, 1, 1) or self.transposed:
                raise ValueError("submanifold convolution has stride 1 and is not transposed")

    @property
    def volume(self) -> int:
        return math.prod(self.kernel_size)
