"""The two statistics kernels of flexplan.nn.sync_batchnorm's CUDA path (the default on NVIDIA
GPUs; FLEXPLAN_SYNC_BN_KERNELS=0 turns it off), around its one all_reduce: pack a rank's sums, then turn the
all-reduced sums into mean / invstd and update the running statistics. float64 throughout:
the global variance is E[x^2] - mean^2 (see that module)."""
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["rows"])
def pack_kernel(mean_ptr, invstd_ptr, out_ptr, channels, rows, BLOCK: tl.constexpr):
    """out[:C] = rows * mean, out[C:2C] = rows * (var + mean^2), out[2C] = rows (float64), from
    batch_norm_stats' mean and invstd taken with eps 0 (invstd = 1/sqrt(var), and 0 where var
    is 0: then var is 0)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < channels
    mean = tl.load(mean_ptr + offs, mask=mask, other=0.0).to(tl.float64)
    invstd = tl.load(invstd_ptr + offs, mask=mask, other=0.0).to(tl.float64)
    positive = invstd > 0
    safe = tl.where(positive, invstd, 1.0)
    var = tl.where(positive, 1.0 / (safe * safe), 0.0)
    n = tl.zeros([BLOCK], dtype=tl.float64) + rows.to(tl.float64)
    tl.store(out_ptr + offs, mean * n, mask=mask)
    tl.store(out_ptr + channels + offs, (var + mean * mean) * n, mask=mask)
    tl.store(out_ptr + 2 * channels + offs * 0, n, mask=offs == 0)


@triton.jit
def finalize_kernel(packed_ptr, consts_ptr, nbt_ptr, stats_ptr, count_ptr, rm_ptr, rv_ptr,
                     channels, TRACK: tl.constexpr, CUMULATIVE: tl.constexpr,
                     BLOCK: tl.constexpr):
    """From the all-reduced sums: stats[0] = mean, stats[1] = 1/sqrt(var + eps) (biased var),
    count = the global row count (int32, for batch_norm_backward_elemt), and with TRACK
    num_batches_tracked incremented and the running statistics moved towards mean and the
    unbiased var by momentum (consts[1]) or by 1 / num_batches_tracked (CUMULATIVE, the
    incremented count); by nothing where no rank had rows. consts[0] = eps. All in float64,
    stored in each output's dtype. One program, a loop over the channels: the increment is
    made once and read by every channel (the module's own add_ of it was one launch more per
    layer and step)."""
    total = tl.load(packed_ptr + 2 * channels)
    rows = tl.maximum(total, 1.0)
    eps = tl.load(consts_ptr)
    lane = tl.arange(0, BLOCK)
    whole = tl.zeros([BLOCK], dtype=tl.float64) + total
    tl.store(count_ptr + lane * 0, whole.to(tl.int32), mask=lane == 0)
    w = 0.0
    if TRACK:
        # (one atomic, its old value shared by every thread: a load and a store by thread 0
        # could let another warp load the count already incremented)
        nbt = tl.atomic_add(nbt_ptr, 1) + 1
        if CUMULATIVE:
            w = 1.0 / nbt.to(tl.float64)
        else:
            w = tl.load(consts_ptr + 1)
        w = tl.where(total > 0, w, 0.0)
    for start in range(0, channels, BLOCK):
        offs = start + lane
        mask = offs < channels
        mean = tl.load(packed_ptr + offs, mask=mask, other=0.0) / rows
        ex2 = tl.load(packed_ptr + channels + offs, mask=mask, other=0.0) / rows
        var = tl.maximum(ex2 - mean * mean, 0.0)
        invstd = 1.0 / tl.sqrt(var + eps)  # float64: correctly rounded
        tl.store(stats_ptr + offs, mean.to(stats_ptr.dtype.element_ty), mask=mask)
        tl.store(stats_ptr + channels + offs, invstd.to(stats_ptr.dtype.element_ty), mask=mask)
        if TRACK:
            unbiased = var * total / tl.maximum(total - 1.0, 1.0)  # one row in all: 0, not NaN
            rm = tl.load(rm_ptr + offs, mask=mask, other=0.0).to(tl.float64)
            rv = tl.load(rv_ptr + offs, mask=mask, other=0.0).to(tl.float64)
            tl.store(rm_ptr + offs, (rm + w * (mean - rm)).to(rm_ptr.dtype.element_ty),
                     mask=mask)
            tl.store(rv_ptr + offs, (rv + w * (unbiased - rv)).to(rv_ptr.dtype.element_ty),
                     mask=mask)
