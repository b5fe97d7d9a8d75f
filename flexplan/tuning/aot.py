"""What the AOT build covers, in one place: the layer shapes, and the conv kernel configs dispatch
returns for them.

The shapes are those of real sparse networks (AOT_WIDTHS, AOT_GEOMETRIES, AOT_DTYPES, rows from
AOT_MIN_ROWS to AOT_MAX_ROWS). For each, `conv_launches` asks what the ops would launch: the
algorithm "auto" resolves to (kernel_configs.choose_algo) and the config dispatch returns for it
(dispatch.config_from: the target's tuned table, else a tuned neighbour bucket's config, else the
heuristic), made into the config the
kernel is launched with as the ops make it. So the build compiles no variant no call can pick,
and a new heuristic or table changes the build by itself. flexplan/aot/variants.py turns the
launches into kernel specializations; tests/test_aot_lean.py checks the set against what
select_config returns over a dense grid of shapes.

Outside the covered shapes (other widths, tiny layers, algorithms named explicitly, a user's own
tuned table) calls still run: Triton's JIT compiles them on first use.
"""
from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, replace

from ..geometry import ConvGeometry
from ..kernel_configs import (ALGORITHMS, FAMILIES, PARTS, PLAN_BLOCK_SIZES, WGRAD, KernelConfig,
                              Problem, choose_algo, config_dtype, has_tf32, precision_config)
from .dispatch import config_from
from .table import TableError, read_table, shipped_table_paths

# Kernel-launching algorithms ("explicit" multiplies on torch's matmul).
KERNEL_ALGORITHMS = tuple(a for a in ALGORITHMS if a != "explicit")
# Layer widths: every multiple of 16 up to 256 (sparse U-Nets and LiDAR backbones: 16 to 256).
AOT_WIDTHS = tuple(range(16, 257, 16))
# Layers of the networks in scripts/e2e_networks.py outside those widths: the 4 input features
# of a LiDAR point (x, y, z, intensity) into the first 16-channel layer.
EXTRA_CHANNEL_PAIRS = ((4, 16),)


def _strided(kernel, stride, padding=0, transposed=False) -> ConvGeometry:
    """A strided (or transposed) geometry; kernel, stride and padding as ConvGeometry.make."""
    return ConvGeometry.make(kernel, stride=stride, padding=padding, submanifold=False,
                             transposed=transposed)


# The layer geometries: each gives a kernel volume the convs cover and the planner kernels' own
# specializations (kernel sizes, strides, paddings are constexprs of the planner kernels). 2D and
# 1D layers run as 3D ones with unit trailing axes (flexplan.nn.spconv_layers.lift).
AOT_GEOMETRIES = (
    ConvGeometry.submanifold_conv(3),             # 3x3x3
    ConvGeometry.submanifold_conv(5),             # 5x5x5
    ConvGeometry.submanifold_conv((3, 3, 1)),     # 2D 3x3
    ConvGeometry.submanifold_conv((3, 1, 1)),     # 1D 3
    _strided(2, stride=2),                         # 2x2x2 down-sampling
    _strided(3, stride=2, padding=1),              # 3x3x3 down-sampling
    _strided((3, 3, 1), stride=(2, 2, 1), padding=(1, 1, 0)),  # 2D 3x3 down-sampling
    # scripts/e2e_networks.py (OpenPCDet's VoxelResBackBone8x): conv4 pads z by 0, conv_out
    # folds z with a 3x1x1 kernel.
    _strided(3, stride=2, padding=(0, 1, 1)),
    _strided((3, 1, 1), stride=(2, 1, 1)),
    _strided(2, stride=2, transposed=True),        # up-sampling (SparseConvTranspose3d)
    _strided(3, stride=2, padding=1, transposed=True),
)
AOT_VOLUMES = tuple(sorted({g.volume for g in AOT_GEOMETRIES}))  # 3, 8, 9, 27, 125
# Volumes of submanifold plans (their grad-input reverses the forward map) and of the others
# (grad-input runs the plan's backward map): ops.conv.dgrad_map.
SUBMANIFOLD_VOLUMES = frozenset(g.volume for g in AOT_GEOMETRIES if g.submanifold)
STRIDED_VOLUMES = frozenset(g.volume for g in AOT_GEOMETRIES if not g.submanifold)
# The dtypes convs run in ("tf32": float32 with TF32 allowed; float32 without: 3xTF32 on
# NVIDIA). float64 (gradcheck) JIT-compiles.
AOT_DTYPES = ("float16", "bfloat16", "float32", "tf32")
# Rows (output rows for the forward, input rows for grad-input; grad-weight's pairs run from the
# rows to rows x volume). From more rows than the next-to-largest row block on, the heuristic's
# blocks no longer depend on the rows; fewer rows (toy inputs) JIT-compile their small blocks.
AOT_MIN_ROWS = PLAN_BLOCK_SIZES[-2] + 1
AOT_MAX_ROWS = 1 << 24


@dataclass(frozen=True)
class ConvLaunch:
    """One conv kernel launch as the ops make it. dtype: the tensors' (AOT_DTYPES); problem: what
    dispatch was asked (its config dtype, the algorithm "auto" picked; rows: one example);
    config: what is launched (splitk 1 or 2: the count is a grid size, only splitting or not is
    compiled in)."""

    dtype: str
    problem: Problem
    config: KernelConfig


def rows_to_cover(part: str, volume: int, tables: dict, low: int = AOT_MIN_ROWS,
                  high: int = AOT_MAX_ROWS) -> list[int]:
    """The row counts whose dispatch reaches every config of rows low..high: both ends of the
    range (in pairs for grad-weight); where a tuned table has buckets of this part and volume,
    both ends of every rows bucket in the range (a bucket takes its own tuned config, or its
    nearest tuned neighbour's, or the heuristic where the workspace bars that: dispatch.
    neighbour_config). Within a stretch of heuristic buckets its blocks are fixed and split-K
    is on up to some row count (gather-GEMM: more rows fill the GPU) or from one on
    (grad-weight: more pairs per offset), so the stretch's ends reach both."""
    if part == "wgrad":
        high *= volume
    rows = {low, high}
    if any(bucket.part == part and bucket.v == volume for bucket in tables):
        rows |= {r for k in range(high.bit_length() + 1) for r in ((1 << k) // 2 + 1, 1 << k)
                 if low <= r <= high}
    return sorted(rows)


def conv_launches(arch: str | None, hip: bool, shared_memory: int | None,
                  channel_pairs=None, dtypes=AOT_DTYPES, volumes=AOT_VOLUMES,
                  rows: tuple[int, int] = (AOT_MIN_ROWS, AOT_MAX_ROWS),
                  tables: dict | None = None, algos=("auto",)) -> tuple[ConvLaunch, ...]:
    """Every conv launch of the covered shapes on a GPU of this arch ("sm_90"), backend and shared
    memory per program; channel_pairs: (ci, co) pairs (default: every pair of AOT_WIDTHS, and
    EXTRA_CHANNEL_PAIRS); tables: {Bucket: KernelConfig} (default: the shipped tables for arch,
    each GPU's in turn: two GPUs of one arch (an H100, an H200) may pick two configs for one
    bucket, and a bundle of the arch serves both); algos: what the layers ask for ("auto", the
    layers' default, or algorithms by name). Deduplicated, in a stable order (dtypes, parts,
    channels, volumes)."""
    per_gpu = target_table_list(arch) if tables is None else [tables]
    if not has_tf32(hip, arch):  # dispatch runs such a GPU's TF32 requests exact (ops/conv.py)
        dtypes = tuple(d for d in dtypes if d != "tf32")
    pairs = tuple(channel_pairs) if channel_pairs is not None else default_channel_pairs()
    out: dict = {}
    for configs in per_gpu or [{}]:
        out.update(dict.fromkeys(_conv_launches(
            hip, shared_memory, pairs, tuple(dtypes), tuple(volumes), tuple(rows),
            tuple(sorted(configs.items(), key=lambda item: item[0].key)), tuple(algos))))
    return tuple(out)


@functools.lru_cache(maxsize=32)
def _conv_launches(hip, shared_memory, pairs, dtypes, volumes, rows, table_items, algos):
    tables = dict(table_items)
    by_config_dtype = {}
    for dtype in dtypes:
        by_config_dtype.setdefault(config_dtype(dtype, hip), []).append(dtype)
    out = {}
    for (cdtype, run_dtypes), part, (ci, co), v, asked in itertools.product(
            by_config_dtype.items(), PARTS, pairs, volumes, algos):
        for n in rows_to_cover(part, v, tables, *rows):
            algo = (choose_algo(part, n, ci, co, v, cdtype) if asked == "auto"  # resolve_algo
                    else asked)
            if algo == "explicit":  # im2col + torch's matmul (variants.im2col_variants)
                continue
            problem = Problem(n, ci, co, v, cdtype, algo, part)
            config = _as_launched(config_from(tables, problem.family, problem, shared_memory),
                                  algo)
            example = Problem(AOT_MIN_ROWS, ci, co, v, cdtype, algo, part)  # rows: not compiled
            for dtype in run_dtypes:
                launched = (precision_config(config, WGRAD, dtype, hip) if part == "wgrad"
                            else config)
                out.setdefault(ConvLaunch(dtype, example, launched), None)
    return tuple(out)


def _as_launched(config: KernelConfig, algo: str) -> KernelConfig:
    """The config as ops.conv launches it: a masked kernel takes the nearest row block
    the plan has a schedule for (plans have every PLAN_BLOCK_SIZES); one split or many compile
    alike."""
    if algo.startswith("masked") and config.block_m not in PLAN_BLOCK_SIZES:
        block_m = min(PLAN_BLOCK_SIZES, key=lambda b: (abs(b - config.block_m), b))
        config = replace(config, block_m=block_m)
    return replace(config, splitk=2) if config.splitk > 2 else config


def default_channel_pairs() -> tuple[tuple[int, int], ...]:
    return tuple(itertools.product(AOT_WIDTHS, repeat=2)) + EXTRA_CHANNEL_PAIRS


def target_table_list(arch: str | None) -> list[dict]:
    """[{Bucket: KernelConfig} per GPU] of the shipped tables dispatch can use on a GPU of arch
    ("sm_90") with this Triton: a table tuned under another Triton version is not used
    (dispatch.load_configs), so its configs are not built either. None: no table."""
    from .device import triton_version

    if arch is None:
        return []
    out = []
    for path in shipped_table_paths():
        try:
            table = read_table(path)
        except TableError:  # dispatch skips it too (with a warning)
            continue
        if table.device.arch == arch and table.device.triton == triton_version():
            out.append({bucket: entry.config for bucket, entry in table.entries.items()})
    return out


def target_tables(arch: str | None) -> dict:
    """The buckets of target_table_list(arch) in one mapping (a later GPU's config where two
    GPUs' tables share a bucket): what some GPU of the arch runs, for counting coverage."""
    configs = {}
    for table in target_table_list(arch):
        configs.update(table)
    return configs


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


def configs_for_aot(dtypes=AOT_DTYPES, volumes=AOT_VOLUMES, channels=None,
                    rows=(AOT_MIN_ROWS, AOT_MAX_ROWS)) -> dict[str, set[KernelConfig]]:
    """{family: set(KernelConfig)} dispatch can return on this machine's GPU (or an H100's shared
    memory): the shipped tables' configs (all GPUs) and the heuristic's over the covered shapes,
    for "auto" and every algorithm named, narrowed by the arguments (channels: widths, every
    pair; rows: the least and most). The build compiles those of "auto" (conv_launches)."""
    pairs = tuple(itertools.product(channels, repeat=2)) if channels is not None else None
    launches = conv_launches(None, False, None, pairs, dtypes, volumes, (min(rows), max(rows)),
                             tables={}, algos=("auto",) + KERNEL_ALGORITHMS)
    out = shipped_configs()
    for launch in launches:
        out[launch.problem.family].add(launch.config)
    return out
