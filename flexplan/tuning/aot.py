"""The kernel configs the AOT build must compile: every config dispatch can return.

Dispatch returns the shipped table's config of the call's bucket, or the heuristic default;
so the set is the shipped tables' configs plus the heuristic over the representatives of the
buckets to cover. The heuristic's compiled parameters (blocks, warps, stages, split or not)
depend only on the bucket; the split count, a grid size, may differ within it, which the
compiled kernel does not care about. (A user's own tuned table may name other configs: those
run JIT-compiled.)
"""
from __future__ import annotations

import itertools

from ..kernel_configs import ALGORITHMS, FAMILIES, PARTS, KernelConfig, heuristic_config
from .buckets import Bucket
from .table import TableError, read_table, shipped_table_paths

# Kernel-launching algorithms ("explicit" is torch only).
KERNEL_ALGORITHMS = tuple(a for a in ALGORITHMS if a != "explicit")
# The problems the AOT build covers by default: channels 1..1024, rows 1..2^24,
# kernel 2^3 (down/up-sampling) 3^3 and 5^3.
AOT_CHANNELS = tuple(1 << i for i in range(11))
AOT_ROWS = tuple(1 << i for i in range(25))
AOT_VOLUMES = (8, 27, 125)
AOT_DTYPES = ("float16", "bfloat16", "float32", "tf32")


def shipped_configs() -> dict[str, set[KernelConfig]]:
    """{family: configs} named by the tables in the package (all GPUs)."""
    out = {family: set() for family in FAMILIES}
    for path in shipped_table_paths():
        try:
            table = read_table(path)
        except TableError as err:
            raise TableError(f"shipped table {path.name}: {err}") from None
        for bucket, entry in table.entries.items():
            out[bucket.family].add(entry.config)
    return out


def heuristic_configs(parts=PARTS, algos=KERNEL_ALGORITHMS, dtypes=AOT_DTYPES,
                      volumes=AOT_VOLUMES, channels=AOT_CHANNELS,
                      rows=AOT_ROWS) -> dict[str, set[KernelConfig]]:
    """{family: configs} the heuristic picks over these buckets (on this machine's SM count,
    132 without a GPU)."""
    out = {family: set() for family in FAMILIES}
    for part, algo, dtype, v, ci, co, n in itertools.product(parts, algos, dtypes, volumes,
                                                              channels, channels, rows):
        problem = Bucket(part, algo, dtype, v, ci, co, n).representative()
        out[problem.family].add(heuristic_config(problem.family, problem))
    return out


def configs_for_aot(**buckets) -> dict[str, set[KernelConfig]]:
    """{family: set(KernelConfig)} to compile ahead of time: shipped-table configs plus the
    heuristic defaults (keyword arguments narrow the buckets, see heuristic_configs)."""
    shipped, heuristic = shipped_configs(), heuristic_configs(**buckets)
    return {family: shipped[family] | heuristic[family] for family in FAMILIES}
