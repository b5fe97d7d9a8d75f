"""Sparse convolution over a ConvPlan: the kernel launchers and the autograd Function.

    out[o] = bias + sum_v W[:, v, :] @ feats[plan.fwd.neighbor_map[o, v]]

Algorithms (forward and backward), selectable by name:
  explicit         im2col (kernels_src/conv_im2col.py, in chunks of bounded size) + the
                   vendor matmul
  implicit         gather-GEMM kernel over all V offsets
  implicit_splitk  the same with the reduction split over a grid axis
  masked           gather-GEMM over the offsets each Gray-code-sorted row block has
  masked_splitk    masked, split over K
  auto             one of the above per part (fwd / dgrad / wgrad) and shape (choose_algo)
Grad-weight runs one kernel over the plan's per-offset pairs (split for the *_splitk
algorithms); "explicit" multiplies its im2col blocks on the vendor matmul.
"""
from __future__ import annotations

import functools
from dataclasses import replace
from typing import NamedTuple, Optional

import torch

from .. import plan_tokens, plan_views
from ..compile_boundary import opaque
from ..device_guard import on_device_of
from ..graph_capture import capturing
from ..kernel_configs import (ALGORITHMS, EXPLICIT_WORKSPACE_BYTES, GATHER_GEMM, IM2COL_BLOCK_K,
                              IM2COL_BLOCK_M, SCHEDULE_CHUNK, WGRAD, KernelConfig, Problem,
                              choose_algo, config_dtype, dispatch_rows, dot_precision,
                              im2col_channel_major_blocks, precision_config, runtime_has_tf32,
                              runtime_is_hip)
from ..kernels_src.conv_gather_gemm import (EPILOGUE_BIAS, EPILOGUE_BN_RELU,
                                            EPILOGUE_BN_RELU_F32, EPILOGUE_NONE,
                                            conv_gather_gemm_kernel)
from ..kernels_src.conv_im2col import im2col_channel_major_kernel, im2col_kernel
from ..kernels_src.conv_wgrad import conv_wgrad_kernel
from ..launch_spec import ACCUMULATOR, ADDRESS, FEATURE, INT32, OUTPUT, SIZE, UNREAD_ADDRESS
from ..launcher import cdiv, launch
from ..plan import MISSING, ConvPlan, GatherMap, kernels_interpreted, kernels_run_on
from . import torch_fallback
from .graph_ops import GRAPH_OP_TAGS, op_context
# From dispatch, not the flexplan.tuning package: that package also wires in the run-time
# tuner, which sits above the ops (it times gather_gemm and wgrad below).
from ..tuning.dispatch import answers_epoch, select_config

AUTO = "auto"


class BatchNormReLU(NamedTuple):
    """An eval-mode BatchNorm followed by a ReLU, as a convolution's epilogue applies it:
    out = max((conv - mean) * weight / sqrt(var + eps) + bias, 0) per output channel. The
    tensors are the BatchNorm's own running statistics and affine parameters ([Co] each, one
    dtype: the features' or float32), read when the kernel runs (never a copy that could go
    stale); the gather-GEMM applies it in its accumulator before the one rounding."""
    mean: torch.Tensor
    var: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor
    eps: float


def bn_relu_torch(out: torch.Tensor, bn: BatchNormReLU) -> torch.Tensor:
    """The epilogue as the modules compute it (torch's eval batch norm, then relu: its dtype
    rules, errors, NaNs and gradients), on a computed output (paths without the fused kernel)."""
    return torch.relu(torch.nn.functional.batch_norm(out, bn.mean, bn.var, bn.weight, bn.bias,
                                                     False, 0.0, bn.eps))


def _dtype_name(dtype: torch.dtype, allow_tf32: bool, device: torch.device | None = None) -> str:
    """The Problem dtype of a call: float32 with TF32 allowed is "tf32" where the GPU has TF32
    dots (kernel_configs.has_tf32), else exact float32, as torch's own matmuls on such GPUs."""
    if dtype == torch.float32 and allow_tf32 and (
            device is None or device.type != "cuda" or runtime_has_tf32(device.index or 0)):
        return "tf32"
    return str(dtype).removeprefix("torch.")


def resolve_algo(algo: str, part: str, n: int, ci: int, co: int, v: int, dtype: str) -> str:
    if algo != AUTO:
        return algo
    return choose_algo(part, dispatch_rows(n), ci, co, v, config_dtype(dtype, runtime_is_hip()))


def _block_for(gmap: GatherMap, block_m: int) -> int:
    """The config's row block if the plan has its schedule, else the nearest one it has."""
    sizes = gmap.block_sizes
    if block_m in sizes:
        return block_m
    if not sizes:
        raise ValueError("plan has no masked schedule (valid_kernel); use algo='implicit'")
    return min(sizes, key=lambda b: (abs(b - block_m), b))


# ---------------------------------------------------------------- launch descriptions
# The one place each launch of this module is written (flexplan/launch_spec.py): the ops below
# launch through these, the AOT build (flexplan/aot/variants.py) records the same functions with
# example arguments, and the tuner takes the constexprs from the *_constexprs functions.

# Memoized: a launch looks its constexprs up instead of building two dicts (host time per call;
# a process sees a few hundred combinations at most). The dicts are shared: read, never modify.
@functools.lru_cache(maxsize=1024)
def gather_gemm_constexprs(cfg: KernelConfig, masked: bool, reverse: bool, dtype: str,
                           hip: bool, weight_kvn: bool) -> dict:
    """dtype: the Problem's (DTYPES); hip: compiled for a ROCm backend; weight_kvn: the weight
    read as [K, V, N] (reads_weight_kvn; an argument, not looked up here: memoized)."""
    return dict(cfg.launch_kwargs(), MASKED=masked, REVERSE_V=reverse,
                PRECISION=dot_precision(dtype, hip), CHUNK=SCHEDULE_CHUNK, WEIGHT_KVN=weight_kvn)


# True: grad-input reads a transposed copy of the weight ([Ci, V, Co], one copy kernel and its
# host ops per conv backward), as before session 46 (A/B runs, scripts/bench_precision.py).
DGRAD_WEIGHT_COPY = False


# The dtypes whose grad-input reads the weight as stored: 16-bit tiles, which Hopper's wgmma
# takes N-major from shared memory as readily as K-major. Its tf32 (and 3xTF32) tiles must be
# K-major: float32 keeps the copy, whose host ops matter least there (a float32 step's backward
# waits for the GPU, not the host: scripts/results/host_costs.md, session 45).
WEIGHT_KVN_DTYPES = frozenset({"float16", "bfloat16"})


def reads_weight_kvn(part: str, dtype: str) -> bool:
    """Whether the gather-GEMM of `part` in `dtype` (a Problem dtype name) reads the conv's
    weight [Co, V, Ci] as it is stored with K = Co and N = Ci ([K, V, N]: 16-bit grad-input),
    rather than as [N, V, K] (the forward, or grad-input over the weight's transposed copy)."""
    return part == "dgrad" and dtype in WEIGHT_KVN_DTYPES and not DGRAD_WEIGHT_COPY


def gather_gemm_weight(weight: torch.Tensor, part: str, dtype: str) -> tuple:
    """(the weight as the gather-GEMM of `part` in `dtype` reads it, weight_kvn): the conv's
    [Co, V, Ci] as it is (the forward, 16-bit grad-input: reads_weight_kvn) or its transposed
    copy (other grad-input)."""
    weight_kvn = reads_weight_kvn(part, dtype)
    if part != "fwd" and not weight_kvn:
        weight = weight.transpose(0, 2).contiguous()
    return weight, weight_kvn


# The gather-GEMM's epilogue argument (kernels_src/conv_gather_gemm.py): none, + bias, or an
# eval BatchNorm and ReLU (BatchNormReLU) whose tensors are in the features' dtype or float32.
NO_EPILOGUE, BIAS_EPILOGUE = EPILOGUE_NONE.value, EPILOGUE_BIAS.value
BN_RELU_EPILOGUE, BN_RELU_F32_EPILOGUE = EPILOGUE_BN_RELU.value, EPILOGUE_BN_RELU_F32.value


@functools.lru_cache(maxsize=1024)
def wgrad_constexprs(cfg: KernelConfig, dtype: str, hip: bool) -> dict:
    return dict(cfg.launch_kwargs(), PRECISION=dot_precision(dtype, hip))


def launch_gather_gemm(run, src: FEATURE, weight: FEATURE, bias: FEATURE, sorted_map_t: INT32,
                       sorted_idx: INT32, chunk_order: INT32, valid_kernel: INT32,
                       valid_kernel_seg: INT32, out: OUTPUT, partials: ACCUMULATOR,
                       tile_counts: INT32, bn_mean: ADDRESS, bn_var: ADDRESS,
                       bn_weight: ADDRESS, bn_bias: ADDRESS, bn_eps: float, epilogue: SIZE,
                       m: SIZE, k: int, n: int, v: int, cfg: KernelConfig, masked: bool,
                       reverse: bool, dtype: str, hip: bool, weight_kvn: bool) -> None:
    """out[m, n] = sum_v src[map[m, v]] @ W_v, then the epilogue (NO_EPILOGUE, BIAS_EPILOGUE:
    + bias, BN_RELU_EPILOGUE / BN_RELU_F32_EPILOGUE: a BatchNormReLU, bn_* the addresses of
    its tensors), over a map's m rows; weight read as [n, v, k], or with weight_kvn as [k, v, n]
    (grad-input reading the conv's [Co, V, Ci] as stored: reads_weight_kvn); partials ([S, m, n]) and
    tile_counts (one zeroed counter per output tile, split_tile_counts) read only under
    split-K; what the epilogue does not read: dummies (UNREAD_ADDRESS for an address)."""
    split = cfg.splitk > 1
    run(conv_gather_gemm_kernel, (output_tiles(m, n, cfg), cfg.splitk),
        src, weight, bias, sorted_map_t, sorted_idx, chunk_order, valid_kernel, valid_kernel_seg,
        out, partials if split else out, tile_counts, bn_mean, bn_var, bn_weight, bn_bias, bn_eps,
        epilogue, m, k, n, v, **gather_gemm_constexprs(cfg, masked, reverse, dtype, hip,
                                                        weight_kvn))


def launch_wgrad(run, grad_out: FEATURE, src: FEATURE, pair_out: INT32, pair_in: INT32,
                 pair_seg: INT32, out: OUTPUT, partials: ACCUMULATOR, tile_counts: INT32,
                 co: int, ci: int, v: int, signal_offsets: int, cfg: KernelConfig, dtype: str,
                 hip: bool) -> None:
    """out[co, v, ci] over the plan's per-offset pairs; partials ([S, co, v, ci]) and
    tile_counts (a zeroed counter per output tile and offset) read only under split-K."""
    split = cfg.splitk > 1
    run(conv_wgrad_kernel, (output_tiles(co, ci, cfg), v, cfg.splitk),
        grad_out, src, pair_out, pair_in, pair_seg, out, partials if split else out, tile_counts,
        co, ci, v, signal_offsets, **wgrad_constexprs(cfg, dtype, hip))


def output_tiles(rows: int, cols: int, cfg: KernelConfig) -> int:
    """Output tiles of a [rows, cols] result under cfg: the launches' first grid axis, and the
    split-K tile counters they need (per offset, for grad-weight)."""
    return -(-rows // cfg.block_m) * -(-cols // cfg.block_n)


# (device index, raw stream) -> zeroed int32 split-K tile counters for launches on that stream
_tile_counts: dict = {}
_MIN_TILE_COUNTS = 4096


def split_tile_counts(device: torch.device, tiles: int) -> torch.Tensor:
    """`tiles` zeroed int32 counters for one split-K launch on the current stream of `device`
    (kernels_src/conv_common.py, split_tile_ticket). The kernels leave them zeroed, so one buffer
    per stream serves every launch there in turn (a stream runs its launches in order; another
    stream has its own). Under CUDA graph capture a buffer for the capture alone (its zeroing
    is captured with it), never the one eager launches share."""
    if capturing(device):
        return torch.zeros(tiles, dtype=torch.int32, device=device)
    index = device.index
    key = (index, torch._C._cuda_getCurrentRawStream(index) if device.type == "cuda" else 0)
    counts = _tile_counts.get(key)
    if counts is None or counts.numel() < tiles:
        size = max(tiles, _MIN_TILE_COUNTS, 2 * counts.numel() if counts is not None else 0)
        counts = _tile_counts[key] = torch.zeros(size, dtype=torch.int32, device=device)
    return counts


def launch_im2col(run, src: FEATURE, nmap: INT32, out: FEATURE, row_start: SIZE, rows: SIZE,
                  k: int, v: int) -> None:
    """Offset-major columns (v * K + k) of `rows` map rows from row_start."""
    run(im2col_kernel, (-(-rows // IM2COL_BLOCK_M), v), src, nmap, out, row_start, rows, k, v,
        BLOCK_M=IM2COL_BLOCK_M, BLOCK_K=IM2COL_BLOCK_K)


def launch_im2col_channel_major(run, src: FEATURE, nmap: INT32, out: FEATURE, row_start: SIZE,
                                rows: SIZE, k: int, v: int, reverse: bool) -> None:
    """Channel-major columns (k * V + v); reverse: offset v gathers through map column V-1-v."""
    block_m, block_k, v_pad = im2col_channel_major_blocks(v)
    run(im2col_channel_major_kernel, (-(-rows // block_m), -(-k // block_k)), src, nmap, out,
        row_start, rows, k, v, REVERSE_V=reverse, BLOCK_M=block_m, BLOCK_K=block_k, V_PAD=v_pad)


# ---------------------------------------------------------------- gather-GEMM (fwd, dgrad)
# The per-part launchers (gather_gemm, wgrad, with resolve_algo and dgrad_map) are public: the
# tuner (flexplan/tuning/cases.py) times exactly what a call runs, config from select_config.

def dgrad_map(plan: ConvPlan) -> tuple[GatherMap, bool]:
    """(map, reverse) of grad-input: submanifold, the forward map with offsets reversed; else
    the plan's backward map."""
    return (plan.fwd, True) if plan.bwd is None else (plan.bwd, False)


def gather_gemm(src, weight, bias, gmap: GatherMap, reverse: bool, part: str, algo: str,
                allow_tf32: bool, bn: BatchNormReLU | None = None) -> torch.Tensor:
    """out[m] = sum_v src[map[m, v]] @ W_v; W_v = W[:, v, :]^T (fwd) or W[:, v', :] (dgrad);
    then bn's epilogue, if given (the Triton kernel applies it before rounding)."""
    co, v, ci = weight.shape
    m = gmap.num_rows
    k, n = (ci, co) if part == "fwd" else (co, ci)
    if m == 0:
        return src.new_empty((m, n))
    if not kernels_run_on(src):  # CPU tensors and compiled kernels: torch alone
        out = torch_fallback.gather_gemm(src, weight, bias, gmap.neighbor_map, reverse, part)
        return out if bn is None else bn_relu_torch(out, bn)
    if algo == "explicit":
        out = _explicit_gather_gemm(src, weight, bias, gmap.neighbor_map, reverse, part)
        return out if bn is None else bn_relu_torch(out, bn)
    if bn is not None and not _bn_in_kernel(bn, src, bias):
        # (tensors the kernel does not read: the epilogue in torch ops after the kernel)
        return bn_relu_torch(gather_gemm(src, weight, bias, gmap, reverse, part, algo,
                                         allow_tf32), bn)
    if not gmap.valid_kernel and algo.startswith("masked"):
        # A map without a schedule (a first sighting's submanifold inference map, an inverse
        # conv's map, a strided training plan's bwd map): a big convolution schedules it, a
        # small one runs every offset of every block (both kept with the map).
        scheduled = masked_schedule_for(gmap, m * v * k * n)
        if scheduled is not None:
            gmap = scheduled
        elif FULL_SCHEDULES:
            gmap = plan_views.full_schedule(gmap)
        else:
            algo = "implicit" + algo.removeprefix("masked")
    out = src.new_empty((m, n))
    cfg, masked, map_t, chunks, valid_kernel, valid_kernel_seg, dtype, hip = _kept_launch(
        gmap, (part, algo, k, n, v, src.dtype, allow_tf32), src.device,
        lambda: _gather_gemm_launch(src, gmap, part, algo, m, ci, co, v, allow_tf32))
    weight, weight_kvn = gather_gemm_weight(weight, part, dtype)
    if cfg.splitk > 1:  # the kernel's last split of each tile sums the partials
        partials = torch.empty((cfg.splitk, m, n), device=src.device,
                               dtype=torch_fallback.accumulator_dtype(src.dtype))
        tile_counts = split_tile_counts(src.device, output_tiles(m, n, cfg))
    else:  # (not read)
        partials, tile_counts = out, gmap.sorted_idx
    if bn is not None:  # (its tensors: contiguous, on src's device, one dtype: _bn_in_kernel)
        norm = (bn.mean.data_ptr(), bn.var.data_ptr(), bn.weight.data_ptr(),
                bn.bias.data_ptr(), bn.eps)
        epilogue = BN_RELU_EPILOGUE if bn.mean.dtype == src.dtype else BN_RELU_F32_EPILOGUE
    else:
        norm, epilogue = _NO_NORM, (NO_EPILOGUE if bias is None else BIAS_EPILOGUE)
    launch_gather_gemm(launch, src, weight, bias if bias is not None else weight, map_t,
                       gmap.sorted_idx, chunks, valid_kernel, valid_kernel_seg, out, partials,
                       tile_counts, *norm, epilogue, m, k, n, v, cfg, masked, reverse, dtype, hip,
                       weight_kvn)
    return out


# (a launch without the BatchNormReLU: its addresses not read)
_NO_NORM = (UNREAD_ADDRESS,) * 4 + (0.0,)


# The multiply-adds (rows x offsets x Ci x Co) from which a convolution over a map without a
# masked schedule has it made (plan_views.masked_schedule) rather than run every offset of
# every block (plan_views.full_schedule): 2^35, about half a millisecond of such work on an
# H100 in fp16, many times the schedule's own cost. LiDAR layers (C <= 128 over 2e4 voxels,
# C 16 over 1e5: at most 2^33.2 on bench_e2e's scans, scripts/probe_conv_work.py) stay below
# it, where a step on new coordinates is host-bound; wide layers (C 256-512 over 5e4 voxels, a
# generative VAE's) reach it.
SCHEDULE_WORK_MIN = 1 << 35
# Whether a map without a schedule runs the masked kernels over a schedule of every offset
# (plan_views.full_schedule: the variants AOT bundles hold) or, False, the implicit kernels
# (variants no bundle holds: JIT-compiled on first use).
FULL_SCHEDULES = True


def masked_schedule_for(gmap: GatherMap, work: int) -> GatherMap | None:
    """gmap with its masked schedule where a convolution of `work` multiply-adds over it is
    worth one (SCHEDULE_WORK_MIN), else None."""
    return plan_views.masked_schedule(gmap) if work >= SCHEDULE_WORK_MIN else None


def _kept_launch(gmap: GatherMap, key: tuple, device: torch.device, resolve) -> tuple:
    """resolve()'s answer for a launch over gmap, kept in gmap.launch_memo under key while
    dispatch's answers hold (answers_epoch): a fresh plan serves a few convs of one shape per
    step, each resolving its config and views again otherwise (host time in a host-bound
    step). Never kept under a config the tuner forces, nor from inside a CUDA graph capture
    (views made there must not outlive it)."""
    epoch = answers_epoch()
    known = gmap.launch_memo.get(key)
    if known is not None and known[0] == epoch and epoch is not None:
        return known[1]
    answer = resolve()
    if epoch is not None and not capturing(device):
        gmap.launch_memo[key] = epoch, answer
    return answer


# (family, part, algo, dispatched rows, Ci, Co, V, dtype, allow_tf32, device) -> (answers_epoch,
# (config, dtype name, hip)): what dispatch answers for a launch of that shape, kept across
# plans: each fresh plan's first convolutions would otherwise build their Problem and ask
# select_config again (host time in a host-bound step on new coordinates; measurements:
# scripts/results/host_costs.md, session 43). Bounded like dispatch's own answers.
_shape_configs: dict = {}
_MAX_SHAPE_CONFIGS = 4096
# False: every launch asks dispatch afresh, as before session 43 (A/B runs,
# scripts/bench_precision.py).
KEEP_SHAPE_CONFIGS = True


def shape_config(family: str, part: str, algo: str, rows: int, ci: int, co: int, v: int,
                 src: torch.Tensor, allow_tf32: bool) -> tuple:
    """(config, dtype name, hip) of a `family` launch of `part` over `rows` rows (pairs for
    grad-weight) of src's dtype and device: select_config's answer for the dispatched Problem
    (with grad-weight's precision_config), kept while dispatch's answers hold (answers_epoch);
    never kept under a config the tuner forces."""
    epoch = answers_epoch()
    rows = dispatch_rows(rows)
    key = (family, part, algo, rows, ci, co, v, src.dtype, allow_tf32, src.device)
    known = _shape_configs.get(key)
    if known is not None and known[0] == epoch and epoch is not None:
        return known[1]
    dtype, hip = _dtype_name(src.dtype, allow_tf32, src.device), runtime_is_hip()
    cfg = select_config(family, Problem(rows, ci, co, v, config_dtype(dtype, hip), algo, part))
    answer = precision_config(cfg, family, dtype, hip), dtype, hip
    if epoch is not None and KEEP_SHAPE_CONFIGS:
        if len(_shape_configs) >= _MAX_SHAPE_CONFIGS:
            _shape_configs.clear()
        _shape_configs[key] = epoch, answer
    return answer


def _gather_gemm_launch(src, gmap: GatherMap, part: str, algo: str, m: int, ci: int, co: int,
                        v: int, allow_tf32: bool) -> tuple:
    """What a gather-GEMM launch over gmap takes besides the call's own tensors: (config,
    masked, sorted_map_t, chunk_order, valid_kernel, valid_kernel_seg, dtype, hip), the same
    for every call of one (part, algo, shape, dtype) on the map (_kept_launch)."""
    cfg, dtype, hip = shape_config(GATHER_GEMM, part, algo, m, ci, co, v, src, allow_tf32)
    masked = algo.startswith("masked")
    # The map's part (its views for the config's row block) is shared by every launch over the
    # map with that block: a fresh plan's forward and grad-input, and its other layers' convs,
    # ask the map once (host time in a host-bound step on new coordinates).
    key = (_MAP_VIEWS, cfg.block_m, masked)
    known = gmap.launch_memo.get(key)
    if known is None:
        known = _map_views(gmap, cfg.block_m, masked)
        if not capturing(src.device):  # (views made there must not outlive the capture)
            gmap.launch_memo[key] = known
    block_m, views = known
    if block_m != cfg.block_m:
        cfg = replace(cfg, block_m=block_m)
    return (cfg, masked, *views, dtype, hip)


# launch_memo's key prefix of _map_views' answers (other keys are _kept_launch's tuples)
_MAP_VIEWS = "map views"


def _map_views(gmap: GatherMap, block_m: int, masked: bool) -> tuple:
    """(the row block a launch of config block block_m runs over gmap, (sorted_map_t,
    chunk_order, valid_kernel, valid_kernel_seg)): the masked kernels' schedule of the nearest
    block size the map has; the implicit kernels read no schedule (the map's sorted_idx in its
    place, unread)."""
    if masked:
        block_m = _block_for(gmap, block_m)
        valid_kernel, valid_kernel_seg = gmap.kernel_offsets(block_m), gmap.valid_kernel_seg[block_m]
    else:
        valid_kernel = valid_kernel_seg = gmap.sorted_idx  # unused by the kernel
    return block_m, (plan_views.sorted_map_t(gmap), plan_views.chunk_order(gmap), valid_kernel,
                     valid_kernel_seg)


def _im2col_chunks(src, nmap, reverse: bool = False, channel_major: bool = False):
    """(first row, [rows, V * K] gathered block) over the map's rows, in equal chunks that keep
    each block within EXPLICIT_WORKSPACE_BYTES (equal: a short last chunk would multiply at a
    fraction of the GEMM rate); missing neighbours read zeros. Columns offset-major (v * K + k)
    or channel_major (k * V + v; then reverse: offset v gathers through map column V - 1 - v)."""
    m, v = nmap.shape
    k = src.shape[1]
    if m == 0:
        return
    nmap = nmap.contiguous()  # (plans hold contiguous maps: then a no-op)
    chunks = cdiv(m * v * k * src.element_size(), EXPLICIT_WORKSPACE_BYTES)
    rows = cdiv(m, chunks)
    for start in range(0, m, rows):
        count = min(rows, m - start)
        cols = src.new_empty((count, v * k))
        if channel_major:
            launch_im2col_channel_major(launch, src, nmap, cols, start, count, k, v, reverse)
        else:
            assert not reverse, "offset-major im2col reads the map's columns in order"
            launch_im2col(launch, src, nmap, cols, start, count, k, v)
        yield start, cols


def _explicit_gather_gemm(src, weight, bias, nmap, reverse, part):
    """Gathered [rows, V * K] blocks (im2col), each times the flattened weight on the vendor
    GEMM: the baseline, and what auto picks for wide 16-bit channels (see choose_algo)."""
    co, v, ci = weight.shape
    # Forward: offset-major columns times [Co, V * Ci]^T. Grad-input: channel-major columns
    # (row o * V + v) times the weight as stored, [Co * V, Ci], with no transposed copy.
    channel_major = part != "fwd"
    w = weight.reshape(co * v, ci) if channel_major else weight.reshape(co, v * ci).t()
    m = nmap.shape[0]
    out = None
    for start, cols in _im2col_chunks(src, nmap, reverse, channel_major):
        if cols.shape[0] == m:  # one chunk, the usual case: two host ops fewer
            out = torch.mm(cols, w)
            break
        if out is None:
            out = src.new_empty((m, w.shape[1]))
        torch.mm(cols, w, out=out[start:start + cols.shape[0]])
    return out if bias is None else out.add_(bias)


# ---------------------------------------------------------------- grad-weight

def wgrad(grad_out, src, plan: ConvPlan, weight_shape, algo: str, allow_tf32: bool,
          out_dtype: torch.dtype | None = None):
    """Grad-weight [Co, V, Ci] in out_dtype (default: src's; an fp32 master weight under
    autocast gets its gradient from the fp32 split-K sums without a 16-bit round trip)."""
    out_dtype = out_dtype or src.dtype
    if not kernels_run_on(src):
        return torch_fallback.wgrad(grad_out, src, plan.fwd.neighbor_map, weight_shape).to(out_dtype)
    co, v, ci = weight_shape
    pairs = plan.num_pairs
    if algo == "explicit" or pairs == 0:
        return _explicit_wgrad(grad_out, src, plan, weight_shape).to(out_dtype)
    cfg, dtype, hip = shape_config(WGRAD, "wgrad", algo, pairs, ci, co, v, src, allow_tf32)
    # Split-K stores out_dtype from its fp32 sums (an fp32 master weight's gradient under
    # autocast, no 16-bit round trip); one split stores the features' dtype, cast after if
    # need be (one binary per config fewer to build ahead of time: aot/variants.py).
    split = cfg.splitk > 1
    out = torch.empty((co, v, ci), dtype=out_dtype if split else src.dtype, device=src.device)
    if split:  # the kernel's last split of each tile sums the partials
        partials = torch.empty((cfg.splitk, co, v, ci), device=src.device,
                               dtype=torch_fallback.accumulator_dtype(src.dtype))
        tile_counts = split_tile_counts(src.device, output_tiles(co, ci, cfg) * v)
    else:  # (not read)
        partials, tile_counts = out, plan.valid_signal_seg
    launch_wgrad(launch, grad_out, src, plan.valid_signal_o, plan.valid_signal_i,
                 plan.valid_signal_seg, out, partials, tile_counts, co, ci, v,
                 plan.signal_offsets, cfg, dtype, hip)
    return out.to(out_dtype)


def _explicit_wgrad(grad_out, src, plan: ConvPlan, weight_shape):
    co, v, ci = weight_shape
    acc_dtype = torch.promote_types(src.dtype, torch.float32)
    grad_w = None  # no output rows: no chunks, a zero gradient
    for start, cols in _im2col_chunks(src, plan.fwd.neighbor_map):
        part = grad_out[start:start + cols.shape[0]].t() @ cols      # [Co, V * Ci]
        # One chunk is the answer; several sum in fp32 (fp64), not in a 16-bit dtype.
        grad_w = part if grad_w is None else grad_w.to(acc_dtype) + part
    if grad_w is None:
        grad_w = src.new_zeros((co, v * ci))
    return grad_w.to(src.dtype).reshape(co, v, ci)


# The launchers' former names, still used by scripts/.
_resolve_algo, _gather_gemm, _wgrad = resolve_algo, gather_gemm, wgrad


# ---------------------------------------------------------------- autograd

def conv_forward(feats, weight, bias, plan: ConvPlan, algo: str, allow_tf32: bool,
                 bn: BatchNormReLU | None = None):
    """The forward of SparseConvFunction (weight [Co, V, Ci], tensors contiguous); bn: an
    epilogue (inference only: nothing here differentiates it)."""
    co, v, ci = weight.shape
    fwd_algo = resolve_algo(algo, "fwd", plan.num_out, ci, co, v,
                            _dtype_name(feats.dtype, allow_tf32, feats.device))
    return gather_gemm(feats, weight, bias, plan.fwd, False, "fwd", fwd_algo, allow_tf32, bn)


class SparseConvFunction(torch.autograd.Function):
    """cast: the autocast dtype (float16 / bfloat16) the weight and bias are cast to inside the
    op, or None. Casting here rather than before the call leaves autograd no cast nodes of its
    own (two per conv and step under autocast, host time in a host-bound step), and returns the
    weight and bias gradients in their own dtype straight from the fp32 accumulators."""

    @staticmethod
    def forward(ctx, feats, weight, bias, plan: ConvPlan, algo: str, allow_tf32: bool,
                cast: torch.dtype | None = None):
        ctx.weight_dtype = weight.dtype
        ctx.bias_dtype = bias.dtype if bias is not None else None
        if cast is not None:
            weight = weight.to(cast)
            bias = bias.to(cast) if bias is not None else None
        out = conv_forward(feats, weight, bias, plan, algo, allow_tf32)
        ctx.save_for_backward(feats, weight)
        ctx.plan, ctx.algo, ctx.allow_tf32, ctx.has_bias = plan, algo, allow_tf32, bias is not None
        return out

    @staticmethod
    def backward(ctx, grad_out):
        feats, weight = ctx.saved_tensors
        plan, algo, allow_tf32 = ctx.plan, ctx.algo, ctx.allow_tf32
        _check_for_training(plan)
        grad_out = grad_out.contiguous()
        grad_feats = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_feats = conv_dgrad(grad_out, weight, plan, algo, allow_tf32)
        if ctx.needs_input_grad[1]:
            grad_weight = conv_wgrad(grad_out, feats, weight.shape, plan, algo, allow_tf32,
                                     ctx.weight_dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = bias_grad(grad_out, ctx.bias_dtype)
        return grad_feats, grad_weight, grad_bias, None, None, None, None


def _check_for_training(plan: ConvPlan) -> None:
    if not plan.for_training:
        raise RuntimeError("this convolution ran on an inference plan (built with "
                           "training=False, e.g. under torch.no_grad), which has no backward "
                           "parts: build the plan with training=True to differentiate")


def conv_dgrad(grad_out, weight, plan: ConvPlan, algo: str, allow_tf32: bool) -> torch.Tensor:
    """Grad-input [N_in, Ci] of grad_out [N_out, Co] (contiguous), weight [Co, V, Ci]."""
    co, v, ci = weight.shape
    dtype = _dtype_name(grad_out.dtype, allow_tf32, grad_out.device)
    gmap, reverse = dgrad_map(plan)
    part_algo = resolve_algo(algo, "dgrad", plan.num_in, ci, co, v, dtype)
    return gather_gemm(grad_out, weight, None, gmap, reverse, "dgrad", part_algo, allow_tf32)


def conv_wgrad(grad_out, feats, weight_shape, plan: ConvPlan, algo: str, allow_tf32: bool,
               out_dtype: torch.dtype) -> torch.Tensor:
    """Grad-weight [Co, V, Ci] in out_dtype of grad_out [N_out, Co] (contiguous) and feats."""
    co, v, ci = weight_shape
    dtype = _dtype_name(feats.dtype, allow_tf32, feats.device)
    part_algo = resolve_algo(algo, "wgrad", plan.num_pairs, ci, co, v, dtype)
    return wgrad(grad_out, feats, plan, weight_shape, part_algo, allow_tf32, out_dtype=out_dtype)


def bias_grad(grad_out, bias_dtype: torch.dtype) -> torch.Tensor:
    if grad_out.is_cuda and bias_dtype == grad_out.dtype:
        # torch's CUDA sum of 16-bit values accumulates in fp32 and rounds once: the same as
        # an fp32 sum cast after, in one op (host time per conv backward)
        return grad_out.sum(0)
    return grad_out.sum(0, dtype=torch_fallback.accumulator_dtype(grad_out.dtype)).to(bias_dtype)


def _check(feats, plan, weight, bias, algo, cast: torch.dtype | None = None):
    """cast: the autocast dtype weight and bias will be cast to (their own dtype then free)."""
    if not isinstance(plan, ConvPlan):
        raise TypeError(f"plan must be a ConvPlan, got {type(plan).__name__}")
    if algo != AUTO and algo not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {algo!r}; choose 'auto' or one of {ALGORITHMS}")
    if not isinstance(feats, torch.Tensor) or feats.dim() != 2:
        raise ValueError(f"feats must be a [N, Ci] tensor, got "
                         f"{tuple(feats.shape) if isinstance(feats, torch.Tensor) else type(feats)}")
    if feats.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        raise TypeError(f"feats must be float16, bfloat16, float32 or float64, got {feats.dtype}")
    kernel = plan.geometry.kernel_size  # 3 axes, or 4 for a 4D plan (ConvGeometry4d)
    if weight.dim() != len(kernel) + 2:
        axes = "Kx, Ky, Kz" if len(kernel) == 3 else "K0, K1, K2, K3"
        raise ValueError(f"weight must have shape [Co, {axes}, Ci], got {tuple(weight.shape)}")
    if tuple(weight.shape[1:-1]) != kernel:
        raise ValueError(f"weight kernel size {tuple(weight.shape[1:-1])} does not match the "
                         f"plan's kernel_size {kernel}")
    if feats.shape[1] != weight.shape[-1]:
        raise ValueError(f"feats has {feats.shape[1]} channels but weight expects "
                         f"Ci = {weight.shape[-1]} (weight shape {tuple(weight.shape)})")
    if feats.shape[0] != plan.num_in:
        raise ValueError(f"feats has {feats.shape[0]} rows but the plan expects "
                         f"{plan.num_in} input voxels")
    if cast is None and weight.dtype != feats.dtype:
        raise TypeError(f"weight dtype {weight.dtype} differs from feats dtype {feats.dtype}: "
                        "cast the model or the features (e.g. model.half()), or run under "
                        "torch.autocast, which casts both")
    if feats.device != plan.device:
        raise ValueError(f"feats is on {feats.device} but the plan is on {plan.device}; "
                         "move the plan with plan.to(device)")
    if weight.device != feats.device:
        raise ValueError(f"weight is on {weight.device} but feats is on {feats.device}")
    if bias is not None:
        if bias.shape != (weight.shape[0],):
            raise ValueError(f"bias must have shape [{weight.shape[0]}], got {tuple(bias.shape)}")
        if (cast is None and bias.dtype != feats.dtype) or bias.device != feats.device:
            raise TypeError(f"bias ({bias.dtype}, {bias.device}) must match feats "
                            f"({feats.dtype}, {feats.device})")


def _autocast_dtype(feats) -> torch.dtype | None:
    """The dtype torch.autocast asks of convolutions on feats' device, or None (not enabled,
    or not a floating dtype this op runs in: float64 inputs stay float64, as under torch's
    own autocast, which leaves float64 alone)."""
    if not isinstance(feats, torch.Tensor):
        return None
    device_type = feats.device.type
    if not torch.is_autocast_enabled(device_type) or feats.dtype == torch.float64:
        return None
    dtype = torch.get_autocast_dtype(device_type)
    return dtype if dtype in (torch.float16, torch.bfloat16) else None


def sparse_conv(feats: torch.Tensor, plan: ConvPlan, weight: torch.Tensor,
                bias: torch.Tensor | None = None, algo: str = AUTO,
                allow_tf32: bool | None = False,
                bn_relu: BatchNormReLU | None = None) -> torch.Tensor:
    """Sparse 3D convolution of feats [N_in, Ci] over `plan`; returns [N_out, Co].

    weight: [Co, Kx, Ky, Kz, Ci] (the plan's kernel size; a 4D plan's: [Co, K0, K1, K2, K3, Ci]);
    bias: [Co] or None.
    algo: "auto" or one of ALGORITHMS.
    float32: by default fp32-grade products on tensor cores (3xTF32 on NVIDIA: each operand
    split into a TF32 high and low part, three TF32 products; IEEE multiply-adds on ROCm).
    allow_tf32=True opts in to plain TF32 (one product: faster, ~1e-3 relative error), as
    torch.backends.cudnn.allow_tf32 does for torch's convolutions; None follows that flag.
    ("explicit" multiplies on torch.mm, which follows torch.backends.cuda.matmul.)
    Accumulates in fp32 (fp64 for float64 inputs).

    Under torch.autocast (fp16 or bf16) the op runs like torch's convolutions: feats, weight
    and bias are cast to the autocast dtype (differentiably: an fp32 master weight gets an fp32
    gradient) and the output is in that dtype. Outside autocast, dtypes must match.

    bn_relu: an eval-mode BatchNorm and a ReLU applied to the output (what a conv -> BatchNorm
    -> ReLU block computes in eval mode; flexplan.nn's SparseSequential passes it there). With
    nothing to differentiate the kernel applies it before rounding (the BatchNorm's tensors in
    the features' dtype or float32); else torch ops after the convolution.
    """
    if torch.compiler.is_compiling():  # the graph's op (below), not a graph break
        out = _graph_sparse_conv(feats, plan, weight, bias, algo, allow_tf32)
        return out if bn_relu is None else bn_relu_torch(out, bn_relu)
    return _eager_sparse_conv(feats, plan, weight, bias, algo, allow_tf32, bn_relu)


def _check_bn(bn: BatchNormReLU, channels: int, device: torch.device) -> BatchNormReLU:
    """bn checked, its eps a Python float (the kernel's fp32 argument, whatever number type
    the BatchNorm holds: an int would be another specialization)."""
    if not isinstance(bn, BatchNormReLU):
        raise TypeError(f"bn_relu must be a BatchNormReLU, got {type(bn).__name__}")
    for name in ("mean", "var", "weight", "bias"):
        t = getattr(bn, name)
        if not isinstance(t, torch.Tensor) or t.shape != (channels,) or t.device != device:
            raise ValueError(f"bn_relu.{name} must be a [{channels}] tensor on {device}, got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t)}")
    return bn if type(bn.eps) is float else bn._replace(eps=float(bn.eps))


def _bn_in_kernel(bn: BatchNormReLU, src: torch.Tensor, bias) -> bool:
    """Whether the kernel applies bn to a launch over src (what gather_gemm's epilogue reads:
    the addresses of bn's tensors): no conv bias, one dtype for bn's tensors, the features' or
    float32, each contiguous and on src's device; not for float64 features (the kernel gets eps
    as a float32: float64 would lose its precision there); not where the interpreter runs the
    kernel over copies of CUDA tensors (the addresses name device memory)."""
    t, dtype, device = bn.mean, src.dtype, src.device
    return (bias is None and dtype != torch.float64 and t.dtype in (dtype, torch.float32)
            and bn.eps > 0  # (torch's batch norm judges any other: some versions refuse 0)
            and all(x.dtype == t.dtype and x.is_contiguous() and x.device == device
                    for x in bn[:4])
            and (device.type == "cpu" or not kernels_interpreted()))


@opaque
def _eager_sparse_conv(feats, plan, weight, bias, algo, allow_tf32, bn=None):
    if allow_tf32 is None:
        allow_tf32 = torch.backends.cudnn.allow_tf32
    cast = _autocast_dtype(feats)
    if cast is not None:
        feats = feats.to(cast)
    _check(feats, plan, weight, bias, algo, cast)
    co, ci = weight.shape[0], weight.shape[-1]  # (a 4D plan's weight has 6 axes)
    w = weight.reshape(co, -1, ci).contiguous()
    b = bias.contiguous() if bias is not None else None
    # Nothing to differentiate (inference, no_grad): the forward without autograd's node and
    # saved tensors (host time per call in a host-bound step).
    differentiable = torch.is_grad_enabled() and (
        feats.requires_grad or w.requires_grad or (b is not None and b.requires_grad))
    if bn is not None:
        bn = _check_bn(bn, co, feats.device)
        if differentiable or (torch.is_grad_enabled() and any(t.requires_grad for t in bn[:4])):
            # Something to differentiate: the epilogue in torch ops after the convolution
            # (gather_gemm does the same for tensors its kernel does not read).
            return bn_relu_torch(_eager_sparse_conv(feats, plan, weight, bias, algo,
                                                    allow_tf32), bn)
    device_type = feats.device.type
    with on_device_of(feats):
        if cast is None:
            if not differentiable:
                return conv_forward(feats.contiguous(), w, b, plan, algo, bool(allow_tf32), bn)
            return SparseConvFunction.apply(feats.contiguous(), w, b, plan, algo,
                                            bool(allow_tf32))
        # Under autocast the op's own torch ops (sums, explicit GEMMs with out=) must not cast
        # again: autocast off for the call (the flag itself: torch.autocast(enabled=False) as a
        # context costs more host time than the rest of a small conv's Python).
        torch.set_autocast_enabled(device_type, False)
        try:
            if not differentiable:
                return conv_forward(feats.contiguous(), w.to(cast),
                                    None if b is None else b.to(cast), plan, algo,
                                    bool(allow_tf32), bn)
            return SparseConvFunction.apply(feats.contiguous(), w, b, plan, algo,
                                            bool(allow_tf32), cast)
        finally:
            torch.set_autocast_enabled(device_type, True)


# ---------------------------------------------------------------- torch.compile
# Under torch.compile the convolution is the custom op flexplan::sparse_conv (its backward two
# more: _dgrad, _wgrad), so a compiled network's graph runs through its layers instead of
# breaking at each; the plan travels as its token (plan_tokens: the fwd map, whose rows the
# fake implementations read). Eager calls never go through the dispatcher (host time per call).

def _graph_sparse_conv(feats, plan, weight, bias, algo, allow_tf32):
    """sparse_conv as torch.compile traces it: the features cast under autocast in the graph,
    then the op (which casts weight and bias itself, as SparseConvFunction does, so that fp32
    master weights get their gradients from the fp32 sums)."""
    if allow_tf32 is None:
        allow_tf32 = torch.backends.cudnn.allow_tf32
    cast = _autocast_dtype(feats)
    if cast is not None:
        feats = feats.to(cast)
    return torch.ops.flexplan.sparse_conv(feats, weight, bias, plan_tokens.token(plan), algo,
                                          bool(allow_tf32), _CAST_NAMES[cast])[0]


# The autocast dtype as the ops take it (a string: "" for none).
_CAST_NAMES = {None: "", torch.float16: "float16", torch.bfloat16: "bfloat16"}
_CASTS = {name: dtype for dtype, name in _CAST_NAMES.items()}


def _op_weight(weight, bias, cast: str):
    """The [Co, V, Ci] weight and the bias the kernels read, in the cast dtype if any."""
    co, ci = weight.shape[0], weight.shape[-1]
    dtype = _CASTS[cast]
    w = weight.reshape(co, -1, ci)
    if dtype is not None:
        w = w.to(dtype)
        bias = bias.to(dtype) if bias is not None else None
    return w.contiguous(), None if bias is None else bias.contiguous()


@torch.library.custom_op("flexplan::sparse_conv", mutates_args=(), tags=GRAPH_OP_TAGS)
def _conv_op(feats: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
             plan_token: torch.Tensor, algo: str, allow_tf32: bool,
             cast: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, the plan's keeper for the backward: plan_tokens.keeper). cast: the autocast
    dtype's name ("" for none) weight and bias are cast to."""
    plan = plan_tokens.plan_of(plan_token)
    _check(feats, plan, weight, bias, algo, _CASTS[cast])
    with op_context(feats):
        w, b = _op_weight(weight, bias, cast)
        out = conv_forward(feats.contiguous(), w, b, plan, algo, allow_tf32)
    return out, plan_tokens.keeper(plan, feats.device)


@_conv_op.register_fake
def _(feats, weight, bias, plan_token, algo, allow_tf32, cast):
    return (feats.new_empty((plan_token.shape[0], weight.shape[0])),
            feats.new_empty((1,), dtype=torch.uint8))


@torch.library.custom_op("flexplan::sparse_conv_dgrad", mutates_args=(), tags=GRAPH_OP_TAGS)
def _dgrad_op(grad_out: torch.Tensor, feats: torch.Tensor, weight: torch.Tensor,
              plan_keeper: torch.Tensor, algo: str, allow_tf32: bool,
              cast: str) -> torch.Tensor:
    plan = plan_tokens.kept_plan(plan_keeper)
    _check_for_training(plan)
    with op_context(grad_out):
        w, _ = _op_weight(weight, None, cast)
        return conv_dgrad(grad_out.contiguous(), w, plan, algo, allow_tf32)


@_dgrad_op.register_fake
def _(grad_out, feats, weight, plan_keeper, algo, allow_tf32, cast):
    return feats.new_empty(feats.shape)


@torch.library.custom_op("flexplan::sparse_conv_wgrad", mutates_args=(), tags=GRAPH_OP_TAGS)
def _wgrad_op(grad_out: torch.Tensor, feats: torch.Tensor, weight: torch.Tensor,
              plan_keeper: torch.Tensor, algo: str, allow_tf32: bool) -> torch.Tensor:
    """Grad-weight in weight's own dtype (an fp32 master weight's, from the fp32 sums)."""
    plan = plan_tokens.kept_plan(plan_keeper)
    _check_for_training(plan)
    co, ci = weight.shape[0], weight.shape[-1]
    with op_context(grad_out):
        grad = conv_wgrad(grad_out.contiguous(), feats.contiguous(),
                          (co, plan.kernel_volume, ci), plan, algo, allow_tf32, weight.dtype)
    return grad.reshape(weight.shape)


@_wgrad_op.register_fake
def _(grad_out, feats, weight, plan_keeper, algo, allow_tf32):
    return weight.new_empty(weight.shape)


def _conv_op_setup(ctx, inputs, output):
    feats, weight, bias, plan_token, algo, allow_tf32, cast = inputs
    ctx.save_for_backward(feats, weight, output[1])
    ctx.algo, ctx.allow_tf32, ctx.cast = algo, allow_tf32, cast
    ctx.bias_dtype = bias.dtype if bias is not None else None


def _conv_op_backward(ctx, grad_out, grad_keeper):
    feats, weight, keeper = ctx.saved_tensors
    grad_feats = grad_weight = grad_bias = None
    if ctx.needs_input_grad[0]:
        grad_feats = torch.ops.flexplan.sparse_conv_dgrad(grad_out, feats, weight, keeper,
                                                          ctx.algo, ctx.allow_tf32, ctx.cast)
    if ctx.needs_input_grad[1]:
        grad_weight = torch.ops.flexplan.sparse_conv_wgrad(grad_out, feats, weight, keeper,
                                                           ctx.algo, ctx.allow_tf32)
    if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
        grad_bias = bias_grad(grad_out, ctx.bias_dtype)
    return grad_feats, grad_weight, grad_bias, None, None, None, None


_conv_op.register_autograd(_conv_op_backward, setup_context=_conv_op_setup)
