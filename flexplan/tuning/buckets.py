"""Problem buckets: the unit a tuned table stores one config for.

Exact: part, algorithm, dtype, kernel volume. Rounded up to a power of two: the GEMM rows N and
the channels Ci, Co (a config that is good for 48 channels is good for 64, and tables stay
small). A bucket's representative problem is its largest one: run-time tuning measures it
and the AOT build enumerates the heuristic over representatives (the heuristic's block sizes,
warps and stages depend only on the bucket; its split count, a grid size, on exact sizes).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..kernel_configs import Problem


def pow2_ceil(x: int) -> int:
    return 1 << max(int(x) - 1, 0).bit_length()


@dataclass(frozen=True)
class Bucket:
    part: str
    algo: str
    dtype: str
    v: int
    ci: int
    co: int
    n: int

    @classmethod
    def of(cls, problem: Problem) -> "Bucket":
        return cls(problem.part, problem.algo, problem.dtype, problem.v,
                   pow2_ceil(problem.ci), pow2_ceil(problem.co), pow2_ceil(problem.n))

    def representative(self) -> Problem:
        """The largest problem of the bucket (validates the names, too)."""
        return Problem(self.n, self.ci, self.co, self.v, self.dtype, self.algo, self.part)

    @property
    def shape(self) -> tuple:
        """Everything but the rows: the buckets a tuned config may lend to (dispatch.
        neighbour_config)."""
        return self.part, self.algo, self.dtype, self.v, self.ci, self.co

    @property
    def family(self) -> str:
        return self.representative().family

    @property
    def key(self) -> str:
        return f"{self.part}/{self.algo}/{self.dtype}/v{self.v}/ci{self.ci}/co{self.co}/n{self.n}"

    @classmethod
    def parse(cls, key: str) -> "Bucket":
        """Inverse of .key; ValueError on anything else."""
        try:
            part, algo, dtype, v, ci, co, n = key.split("/")
            nums = [int(field[len(tag):]) for field, tag in
                    ((v, "v"), (ci, "ci"), (co, "co"), (n, "n")) if field.startswith(tag)]
        except ValueError:
            raise ValueError(f"bad bucket key {key!r}") from None
        if len(nums) != 4 or min(nums) < 1 or any(x != pow2_ceil(x) for x in nums[1:]):
            raise ValueError(f"bad bucket key {key!r}")
        bucket = cls(part, algo, dtype, *nums)
        bucket.representative()  # unknown part / algo / dtype -> ValueError
        return bucket

    def __str__(self) -> str:
        return self.key
