"""Kernel configuration facts shared by the planner, the kernels, the tuner and the AOT build.

One place for: the row-block sizes plans are built for, the launch config type, the candidate
config space of each kernel family, the description of one problem, and the heuristic default
config (what runs until the tuner has measured this GPU).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace

# Row-block sizes of the masked implicit GEMM kernels. The planner builds valid_kernel /
# valid_kernel_seg for each, so every masked-kernel config must take its BLOCK_M from here.
PLAN_BLOCK_SIZES = (16, 32, 64, 128)
# The gather kernels run the sorted rows in chunks of this many (plan_views.chunk_order); every
# row block size of a kernel config divides it.
SCHEDULE_CHUNK = max(PLAN_BLOCK_SIZES)
# Maps of fewer rows run their chunks in the Gray order itself (plan_views.chunk_order then
# costs no launch): the spatial chunk order pays in L2 reuse on big maps (scripts/bench_submconv.py;
# scripts/results/design_measurements.md), not at LiDAR sizes (scripts/results/chunk_order.md),
# where a step with new coordinates is host-bound.
CHUNK_ORDER_MIN_ROWS = 1 << 18

# Kernel families: the gather-GEMM (forward and grad-input) and grad-weight over pairs.
GATHER_GEMM = "conv_gather_gemm"
WGRAD = "conv_wgrad"
FAMILIES = (GATHER_GEMM, WGRAD)

# Convolution algorithms ("auto" resolves to one of these per problem, see choose_algo).
ALGORITHMS = ("explicit", "implicit", "implicit_splitk", "masked", "masked_splitk")
PARTS = ("fwd", "dgrad", "wgrad")
DTYPES = ("float16", "bfloat16", "float32", "tf32", "float64")

# Split-K partial sums live in an fp32 workspace; cap it so split-K never costs much memory.
SPLITK_WORKSPACE_BYTES = 256 << 20
# The explicit algorithm gathers [rows, V * K] blocks (im2col) of at most this size at a time.
EXPLICIT_WORKSPACE_BYTES = 128 << 20
# From this many reduced and output channels on, 16-bit forward / grad-input run faster as
# im2col + the vendor GEMM than as a gather-GEMM kernel (faster at C = 1024, slower at C = 512;
# measurements: scripts/results/design_measurements.md): the GEMM dominates and the gather
# costs little next to it.
EXPLICIT_MIN_CHANNELS = 768
# The offset-major im2col kernel's tile: rows x channels per step (the tiles swept performed
# alike; (measurements: scripts/results/design_measurements.md)).
IM2COL_BLOCK_M, IM2COL_BLOCK_K = 16, 256


def im2col_channel_major_blocks(volume: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_K, V_PAD) of the channel-major im2col kernel: 32 channels of every
    offset, as many rows as fill 4096 elements (4 x 32 the fastest of six tiles tried;
    measurements: scripts/results/design_measurements.md)."""
    v_pad = 1 << (volume - 1).bit_length()
    return max(1, 4096 // (32 * v_pad)), 32, v_pad


@dataclass(frozen=True)
class KernelConfig:
    """One launch configuration. For the gather-GEMM, BLOCK_M tiles rows, BLOCK_N output
    channels, BLOCK_K the reduced channels; for grad-weight, BLOCK_M tiles Co, BLOCK_N Ci and
    BLOCK_K the pairs. SPLITK splits the reduction over a grid axis."""

    block_m: int
    block_n: int
    block_k: int
    splitk: int = 1
    num_warps: int = 4
    num_stages: int = 2

    def launch_kwargs(self) -> dict:
        """Constexprs and launch options; the split count itself is a grid axis."""
        return dict(BLOCK_M=self.block_m, BLOCK_N=self.block_n, BLOCK_K=self.block_k,
                    SPLIT=self.splitk > 1, num_warps=self.num_warps, num_stages=self.num_stages)


# tl.dot input precision per Problem dtype and backend. float32 without TF32 is "exact": on
# NVIDIA three TF32 products (a_hi b_hi + a_hi b_lo + a_lo b_hi, Triton's "tf32x3": tensor
# cores at fp32-grade accuracy, where "ieee" would multiply-add on the CUDA cores); ROCm
# backends have no tf32x3, so "ieee" there. Other dtypes ignore it: one value, one binary.
def dot_precision(dtype: str, hip: bool) -> str:
    if dtype == "tf32":
        return "tf32"
    if dtype == "float32":
        return "ieee" if hip else "tf32x3"
    return "ieee"


# ROCm GPUs whose dot takes TF32 inputs in Triton (CDNA3's XF32); the others (gfx90a, RDNA)
# refuse input_precision="tf32" at compile time, so float32 with TF32 allowed runs exact there.
HIP_TF32_ARCHS = ("gfx942",)


def has_tf32(hip: bool, arch: str | None) -> bool:
    """Can a GPU of this backend and arch ("gfx90a"; NVIDIA: any, all from sm_80 have TF32) run
    tf32 dots? An unknown ROCm arch (None) is taken as one without."""
    return not hip or (arch or "").split(":")[0] in HIP_TF32_ARCHS


@functools.lru_cache(maxsize=None)
def runtime_has_tf32(device_index: int) -> bool:
    """has_tf32 of this process's GPU of that index (its gcnArchName on ROCm)."""
    if not runtime_is_hip():
        return True
    import torch

    return has_tf32(True, torch.cuda.get_device_properties(device_index).gcnArchName)


# Dispatch (choose_algo, select_config) decides on a row count rounded up to its
# DISPATCH_ROW_BITS leading bits: at most 12.5% above the exact count and never past the power of
# two at or above it, so the tuned tables' buckets and the heuristic's row tiles are the exact
# count's. With new coordinates every step the exact counts are new every call, and each call
# missed every answer cache (the algorithm, the config, the heuristic: ~30 us of host time per
# call against ~5 us for a repeated count, scripts/results/host_costs.md); on this grid a
# job's layers ask a few classes each, answered from the caches after the first steps. The
# kernels are launched with the exact counts.
DISPATCH_ROW_BITS = 4


def dispatch_rows(n: int) -> int:
    """n rounded up to DISPATCH_ROW_BITS leading bits (n itself when it has no more)."""
    shift = n.bit_length() - DISPATCH_ROW_BITS
    return n if shift <= 0 else -(-n >> shift) << shift


def config_dtype(dtype: str, hip: bool) -> str:
    """The dtype whose configs (tables, heuristic, algorithm choice) a problem of `dtype` runs:
    float32 on NVIDIA multiplies on tensor cores (3xTF32, dot_precision) as tf32 does, so it
    takes tf32's tiles; the IEEE tiles of float32 are for CUDA cores (ROCm's float32)."""
    return "tf32" if dtype == "float32" and not hip else dtype


# 3xTF32 grad-weight tiles: its reduction runs over pairs, and a deep BLOCK_K of split operands
# spills registers; tf32's deeper tiles ran the encoder's 16- and 32-channel layers several
# times slower (scripts/results/bench_layers.md, notes; measured with scripts/probe_parts.py).
_TF32X3_WGRAD_BLOCK_K, _TF32X3_WGRAD_STAGES = 64, 2


def precision_config(cfg: KernelConfig, family: str, dtype: str, hip: bool) -> KernelConfig:
    """The config a problem of `dtype` launches, given the one its config_dtype selected: 3xTF32
    grad-weight keeps shallower tiles than tf32's."""
    if family == WGRAD and dot_precision(dtype, hip) == "tf32x3" and (
            cfg.block_k > _TF32X3_WGRAD_BLOCK_K or cfg.num_stages > _TF32X3_WGRAD_STAGES):
        return replace(cfg, block_k=min(cfg.block_k, _TF32X3_WGRAD_BLOCK_K),
                       num_stages=min(cfg.num_stages, _TF32X3_WGRAD_STAGES))
    return cfg


def runtime_dtypes(problem_dtype: str, hip: bool) -> tuple[str, ...]:
    """The dtypes that run a problem of this (config) dtype: config_dtype's inverse, what the
    AOT registry builds for each configured problem."""
    return tuple(d for d in DTYPES if config_dtype(d, hip) == problem_dtype)


@functools.lru_cache(maxsize=None)
def runtime_is_hip() -> bool:
    """Is this process's torch a ROCm build (kernels compile for the HIP backend)?"""
    import torch

    return torch.version.hip is not None


@dataclass(frozen=True)
class Problem:
    """One kernel call to configure, in convolution terms.

    n:  rows of the GEMM: output rows (fwd), input rows (dgrad), all pairs (wgrad).
    ci, co: the layer's input / output channels; v: kernel volume.
    dtype: one of DTYPES ("tf32" = float32 with TF32 allowed); algo: one of ALGORITHMS;
    part: one of PARTS.
    """

    n: int
    ci: int
    co: int
    v: int
    dtype: str
    algo: str
    part: str

    def __post_init__(self):
        if self.algo not in ALGORITHMS:
            raise ValueError(f"unknown algorithm {self.algo!r}; choose one of {ALGORITHMS}")
        if self.part not in PARTS:
            raise ValueError(f"unknown part {self.part!r}; choose one of {PARTS}")
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; choose one of {DTYPES}")

    @property
    def family(self) -> str:
        return WGRAD if self.part == "wgrad" else GATHER_GEMM

    @property
    def gemm_mkn(self) -> tuple[int, int, int]:
        """(M, K, N) of the GEMM one kernel computes (per offset for wgrad: K = pairs)."""
        if self.part == "fwd":
            return self.n, self.ci, self.co
        if self.part == "dgrad":
            return self.n, self.co, self.ci
        return self.co, max(self.n // max(self.v, 1), 1), self.ci

    @property
    def splitk_allowed(self) -> bool:
        return self.algo.endswith("_splitk")

    @property
    def element_bytes(self) -> int:
        return {"float16": 2, "bfloat16": 2, "float64": 8}.get(self.dtype, 4)


# The candidate space of each family, in one place (the tuner and the AOT build enumerate it).
CANDIDATE_AXES = {
    # Stages: Triton divides num_stages - 1 among the levels of a load chain (the gather-GEMM's
    # map -> features, grad-weight's pairs -> rows: two), so 3, 5 and 7 keep 1, 2 and 3 tiles
    # in flight (2 and 4 schedule the same buffers differently).
    GATHER_GEMM: dict(block_m=PLAN_BLOCK_SIZES, block_n=(16, 32, 64, 128, 256), block_k=(16, 32, 64, 128),
                      splitk=(1, 2, 4, 8, 16), num_warps=(4, 8), num_stages=(2, 3, 4, 5, 7)),
    WGRAD: dict(block_m=(16, 32, 64, 128), block_n=(16, 32, 64, 128), block_k=(32, 64, 128, 256),
                splitk=(1, 2, 4, 8, 16, 32, 64), num_warps=(4, 8), num_stages=(2, 3, 4, 5, 7)),
}


# float64 tiles multiply-add on CUDA cores (kernels_src/conv_common.dot_acc): a BLOCK_K this
# small keeps the [M, K, N] product of a 32 x 32 tile in registers.
_FLOAT64_BLOCK_K = 8


def _pow2_at_least(x: int, low: int = 16) -> int:
    return max(low, 1 << max(int(x) - 1, 0).bit_length())


def candidate_configs(problem: Problem) -> list[KernelConfig]:
    """Every config of the problem's family worth trying on it: blocks no larger than needed,
    split-K only for split-K algorithms, and fp32 workspaces within SPLITK_WORKSPACE_BYTES."""
    axes = CANDIDATE_AXES[problem.family]
    m, k, n = problem.gemm_mkn
    out = []
    for bm in axes["block_m"]:
        if bm > _pow2_at_least(m):
            continue
        for bn in axes["block_n"]:
            if bn > _pow2_at_least(n):
                continue
            for bk in axes["block_k"]:
                if bk > _pow2_at_least(k):
                    continue
                for s in axes["splitk"]:
                    if s > 1 and not (problem.splitk_allowed and splitk_workspace_fits(problem, s)):
                        continue
                    for w in axes["num_warps"]:
                        for st in axes["num_stages"]:
                            out.append(KernelConfig(bm, bn, bk, s, w, st))
    return out


def splitk_workspace_fits(problem: Problem, splitk: int) -> bool:
    """Whether `splitk` splits of `problem` keep their fp32 partials within
    SPLITK_WORKSPACE_BYTES."""
    if problem.part == "wgrad":
        size = problem.co * problem.v * problem.ci
    else:
        m, _, n = problem.gemm_mkn
        size = m * n
    return splitk * size * 4 <= SPLITK_WORKSPACE_BYTES


@functools.lru_cache(maxsize=None)
def num_sms() -> int:
    """Streaming multiprocessors (compute units) of the current GPU; 132 (H100) without one."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    return 132


@functools.lru_cache(maxsize=None)
def shared_memory_bytes() -> int:
    """Shared memory one program may use on the current GPU; 227 KiB (H100) without one."""
    import torch

    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        # ROCm reports no opt-in size: its per-block size is the whole LDS.
        return getattr(props, "shared_memory_per_block_optin", props.shared_memory_per_block)
    return 232448


def _pipelined_stages(bm: int, bn: int, bk: int, element_bytes: int, shared_memory: int) -> int:
    """5 (three A and B tiles in flight) where they fit in shared memory with room to spare,
    else 3 (two)."""
    three_tiles = 3 * (bm * bk + bk * bn) * element_bytes
    return 5 if three_tiles <= shared_memory * 3 // 4 else 3


def _splitk_for(problem: Problem, tiles: int, k_iters: int, programs_per_sm: int) -> int:
    """Splits (powers of 2, <= 64) until the grid has programs_per_sm programs per SM, keeping
    >= 4 reduction iterations per split and the workspace within SPLITK_WORKSPACE_BYTES."""
    if not problem.splitk_allowed:
        return 1
    splitk = 1
    while (tiles * splitk * 2 <= programs_per_sm * num_sms() and k_iters // (splitk * 2) >= 4
           and splitk_workspace_fits(problem, splitk * 2) and splitk * 2 <= 64):
        splitk *= 2
    return splitk


# Memoized: every op call asks (a few microseconds each, several per forward + backward).
@functools.lru_cache(maxsize=4096)
def heuristic_config(family: str, problem: Problem, shared_memory: int | None = None) -> KernelConfig:
    """A reasonable config without tuning (the tuned tables, where present, override it), for a
    GPU with `shared_memory` bytes per program (default: the current GPU's).

    From a sweep (scripts/sweep_submconv_configs.py; scripts/results/design_measurements.md):
    128-row tiles (64 for <= 32 output channels), 256 output channels per tile from N = 256 up,
    BLOCK_K 64 for 16-bit and 32 for fp32 (TF32), three tiles in flight where shared memory
    holds them;
    grad-weight wants many programs (~16 per SM, split over pairs) and long pair chunks when
    channels are few.
    """
    if family != problem.family:
        raise ValueError(f"problem part {problem.part!r} belongs to {problem.family}, not {family}")
    m, k, n = problem.gemm_mkn
    if family == GATHER_GEMM:
        if problem.dtype == "float64":  # correctness path (gradcheck), not tuned
            bm, bn, bk, warps, stages = 32, min(32, _pow2_at_least(n)), _FLOAT64_BLOCK_K, 4, 2
        else:
            wide = problem.element_bytes <= 2
            bn = 256 if n >= 256 else min(128, _pow2_at_least(n))
            bk = min(64 if wide or bn == 256 else 32, _pow2_at_least(k))
            bm = min(64 if bn <= 32 else 128, _pow2_at_least(m))
            warps = 8 if bn == 256 else 4
            stages = _pipelined_stages(bm, bn, bk, problem.element_bytes,
                                       shared_memory or shared_memory_bytes())
        tiles = -(-m // bm) * -(-n // bn)
        # ~8 programs per SM: fewer leave a ragged last wave (e.g. 164 tiles of 128x256 on 132 SMs).
        splitk = _splitk_for(problem, tiles, problem.v * -(-k // bk), programs_per_sm=8)
    else:
        bm = min(128, _pow2_at_least(m))
        bn = min(128, _pow2_at_least(n))
        widest = max(bm, bn)
        bk = 256 if widest <= 32 else 128 if widest <= 64 else 64
        if problem.dtype == "float64":
            bm, bn, bk = min(bm, 32), min(bn, 32), _FLOAT64_BLOCK_K
        warps, stages = 4, 3
        tiles = -(-m // bm) * -(-n // bn) * problem.v
        splitk = _splitk_for(problem, tiles, -(-k // bk), programs_per_sm=16)
    return KernelConfig(bm, bn, bk, splitk, warps, stages)


@functools.lru_cache(maxsize=4096)
def choose_algo(part: str, n: int, ci: int, co: int, v: int, dtype: str) -> str:
    """What algo="auto" runs. 16-bit forward / grad-input with wide channels on both sides:
    explicit (im2col + vendor GEMM). Otherwise masked implicit GEMM (with the sorted, transposed
    map it beats plain implicit at every width swept, 32 to 512 channels), split
    over K when the output tiles alone cannot fill the GPU (few rows, or grad-weight's small
    [Co, Ci] per offset)."""
    if part != "wgrad" and dtype in ("float16", "bfloat16") and min(ci, co) >= EXPLICIT_MIN_CHANNELS:
        return "explicit"
    probe = Problem(n, ci, co, v, dtype, "masked_splitk", part)
    return probe.algo if heuristic_config(probe.family, probe).splitk > 1 else "masked"
