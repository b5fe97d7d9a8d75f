"""Sparse convolution: every algorithm x dtype against float64 references, forward and backward.

References: a dense conv3d on the grid (independent of the planner) and a per-offset gather
loop over the plan's neighbour map (also covers hand-made general plans with a backward map).
"""
from __future__ import annotations

import zlib

import pytest
import torch
import torch.nn.functional as F

from flexplan import ConvGeometry, SparseTensor, build_plan, plan_views
from flexplan.kernel_configs import ALGORITHMS, SCHEDULE_CHUNK
from flexplan.nn import SubMConv3d
from flexplan.ops import sparse_conv
from flexplan.plan import MISSING, ConvPlan
from flexplan.plan_views import chunk_order, sorted_map_t
from flexplan.planner.segments import gather_map, valid_signal
from flexplan.workloads import random_coords, sphere_shell

ALGOS = ALGORITHMS + ("auto",)
# dtype name -> (torch dtype, allow_tf32, relative tolerance on max |error| / max |ref|).
# Half types: inputs are rounded before the float64 reference sees them, so the error is the
# output rounding plus fp32 accumulation order.
DTYPES = {
    "float64": (torch.float64, False, 1e-12),
    "float32": (torch.float32, False, 2e-5),
    "tf32": (torch.float32, True, 5e-3),
    "float16": (torch.float16, False, 3e-3),
    "bfloat16": (torch.bfloat16, False, 2e-2),
}


# ------------------------------------------------------------------ references (float64)

def dense_submconv(feats, coords, spatial_shape, batch_size, weight, bias, dilation):
    """Submanifold conv as a dense conv3d, read back at the active voxels (differentiable)."""
    b, x, y, z = coords.long().unbind(1)
    grid = feats.new_zeros((batch_size, *spatial_shape, feats.shape[1]))
    grid = grid.index_put((b, x, y, z), feats).permute(0, 4, 1, 2, 3)
    kernel = weight.shape[1:4]
    out = F.conv3d(grid, weight.permute(0, 4, 1, 2, 3), dilation=dilation,
                   padding=tuple(d * (k // 2) for k, d in zip(kernel, dilation)))
    out = out.permute(0, 2, 3, 4, 1)[b, x, y, z]
    return out + bias if bias is not None else out


def gather_conv(feats, neighbor_map, weight, bias):
    """out[m] = bias + sum_v weight[:, v] @ feats[neighbor_map[m, v]]; weight [Co, V, Ci]."""
    out = feats.new_zeros((neighbor_map.shape[0], weight.shape[0]))
    for v in range(neighbor_map.shape[1]):
        rows = (neighbor_map[:, v] != MISSING).nonzero()[:, 0]
        out = out.index_add(0, rows, feats[neighbor_map[rows, v].long()] @ weight[:, v].t())
    return out + bias if bias is not None else out


def submanifold_case(num, shape=(8, 8, 8), kernel_size=3, dilation=1, batch_size=1, seed=0):
    gen = torch.Generator().manual_seed(seed)
    coords = random_coords(num, shape, batch_size, generator=gen)
    geometry = ConvGeometry.submanifold_conv(kernel_size, dilation)
    return coords, build_plan(coords, shape, batch_size, geometry)


def random_general_plan(num_in, num_out, kernel_size=3, density=0.4, seed=0) -> ConvPlan:
    """A hand-made strided-style plan (N_in != N_out): per offset a random partial one-to-one
    matching of output rows to input rows, and its inverse as the backward map."""
    gen = torch.Generator().manual_seed(seed)
    geometry = ConvGeometry.make(kernel_size, stride=2, submanifold=False)
    v = geometry.volume
    fwd = torch.full((num_out, v), MISSING, dtype=torch.int32)
    bwd = torch.full((num_in, v), MISSING, dtype=torch.int32)
    for k in range(v):
        count = int(density * min(num_in, num_out) * float(torch.rand((), generator=gen)) * 2)
        count = min(count, num_in, num_out)
        outs = torch.randperm(num_out, generator=gen)[:count]
        ins = torch.randperm(num_in, generator=gen)[:count]
        fwd[outs, k] = ins.to(torch.int32)
        bwd[ins, k] = outs.to(torch.int32)
    sig_i, sig_o, sig_seg = valid_signal(fwd)
    blocks = (16, 32, 64, 128)
    return ConvPlan(geometry=geometry, batch_size=1, in_spatial_shape=(16, 16, 16),
                    out_spatial_shape=(8, 8, 8), num_in=num_in, num_out=num_out,
                    out_coords=torch.zeros((num_out, 4), dtype=torch.int32),
                    fwd=gather_map(fwd, blocks), bwd=gather_map(bwd, blocks),
                    valid_signal_i=sig_i, valid_signal_o=sig_o, valid_signal_seg=sig_seg)


def rel_err(got, ref) -> float:
    return float((got.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def make_inputs(n, ci, co, kernel, dtype, device, seed, bias=True):
    gen = torch.Generator().manual_seed(seed)
    make = lambda *s: torch.randn(*s, generator=gen).to(dtype).to(device).requires_grad_()  # noqa: E731
    return (make(n, ci), make(co, *kernel, ci), make(co) if bias else None)


def run_and_grads(feats, plan, weight, bias, algo, allow_tf32, grad_out):
    """(out, the gradients of those of feats, weight, bias that require one)."""
    out = sparse_conv(feats, plan, weight, bias, algo=algo, allow_tf32=allow_tf32)
    inputs = [t for t in (feats, weight, bias) if t is not None and t.requires_grad]
    return (out, *torch.autograd.grad(out, inputs, grad_out))


def reference_and_grads(fn, feats, weight, bias, grad_out):
    leaves = [t.detach().double().cpu().requires_grad_(t.requires_grad) if t is not None else None
              for t in (feats, weight, bias)]
    out = fn(*leaves)
    return (out.detach(), *torch.autograd.grad(
        out, [t for t in leaves if t is not None and t.requires_grad], grad_out.double().cpu()))


def check_all(got, ref, tol, what, names=("out", "grad_feats", "grad_weight", "grad_bias")):
    assert len(got) == len(ref) <= len(names)
    for name, g, r in zip(names, got, ref):
        err = rel_err(g.detach().cpu(), r)
        assert err <= tol, f"{what}: {name} relative error {err:.3g} > {tol:g}"


# ------------------------------------------------------------------ every algorithm x dtype

@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("algo", ALGOS)
def test_submanifold_matches_dense_and_gather(algo, dtype_name, device):
    dtype, tf32, tol = DTYPES[dtype_name]
    seed = zlib.crc32(f"{algo}/{dtype_name}".encode()) % 1000
    coords, plan = submanifold_case(100, seed=seed)  # several row tiles of every config
    coords, plan = coords.to(device), plan.to(device)
    feats, weight, bias = make_inputs(coords.shape[0], 5, 7, (3, 3, 3), dtype, device, seed)
    grad_out = torch.randn(coords.shape[0], 7, generator=torch.Generator().manual_seed(seed + 1))
    got = run_and_grads(feats, plan, weight, bias, algo, tf32, grad_out.to(dtype).to(device))
    grad_out = grad_out.to(dtype)  # the kernels saw the rounded gradient
    dense = reference_and_grads(
        lambda f, w, b: dense_submconv(f, coords.cpu(), (8, 8, 8), 1, w, b, (1, 1, 1)),
        feats, weight, bias, grad_out)
    check_all(got, dense, tol, f"{algo}/{dtype_name} vs dense conv3d")
    nmap = plan.fwd.neighbor_map.cpu()
    gather = reference_and_grads(lambda f, w, b: gather_conv(f, nmap, w.reshape(7, 27, 5), b),
                                 feats, weight, bias, grad_out)
    check_all(got, gather, tol, f"{algo}/{dtype_name} vs gather reference")


@pytest.mark.parametrize("algo", ALGOS)
def test_general_plan_with_backward_map(algo, device):
    """Strided/transposed-style plans: grad-input gathers through plan.bwd, offsets unreversed."""
    plan = random_general_plan(num_in=90, num_out=50, seed=7).to(device)
    feats, weight, bias = make_inputs(90, 6, 5, (3, 3, 3), torch.float64, device, seed=3)
    grad_out = torch.randn(50, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    got = run_and_grads(feats, plan, weight, bias, algo, False, grad_out.to(device))
    nmap = plan.fwd.neighbor_map.cpu()
    ref = reference_and_grads(lambda f, w, b: gather_conv(f, nmap, w.reshape(5, 27, 6), b),
                              feats, weight, bias, grad_out)
    check_all(got, ref, 1e-12, f"general plan/{algo}")


@pytest.mark.parametrize("algo", ALGOS)
def test_gradcheck_float64(algo, device):
    coords, plan = submanifold_case(14, shape=(3, 3, 3), seed=11)
    feats, weight, bias = make_inputs(coords.shape[0], 2, 3, (3, 3, 3), torch.float64, device, 5)
    fn = lambda f, w, b: sparse_conv(f, plan.to(device), w, b, algo=algo)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (feats, weight, bias), fast_mode=True)


# ------------------------------------------------------------------ edge cases

EDGE_ALGOS = ("explicit", "implicit_splitk", "masked", "masked_splitk")


@pytest.mark.parametrize("algo", EDGE_ALGOS)
@pytest.mark.parametrize("case", ["empty", "one_voxel", "isolated", "odd_channels", "kernel5",
                                  "dilation2", "no_bias", "batch2", "channels48x32"])
def test_edge_cases(case, algo, device):
    ci, co, kernel, dilation, bias, batch, shape, num = 5, 4, 3, 1, True, 1, (8, 8, 8), 80
    if case == "empty":
        num = 0
    elif case == "one_voxel":
        num = 1
    elif case == "odd_channels":
        ci, co = 3, 17
    elif case == "kernel5":  # 125 offsets; 60 voxels of 8^3 still meet ~14 neighbours each
        kernel, num = 5, 60
    elif case == "dilation2":
        dilation = 2
    elif case == "no_bias":
        bias = False
    elif case == "batch2":
        batch = 2
    elif case == "channels48x32":  # K a multiple of BLOCK_K (dgrad) and not (fwd: 48 of 64)
        ci, co = 48, 32
    if case == "isolated":  # every voxel 2 apart: only the centre offset ever hits
        g = torch.arange(0, 8, 2)
        xyz = torch.stack(torch.meshgrid(g, g, g, indexing="ij"), -1).reshape(-1, 3)
        coords = torch.cat([torch.zeros_like(xyz[:, :1]), xyz], 1).to(torch.int32)
        plan = build_plan(coords, shape, 1, ConvGeometry.submanifold_conv(kernel, dilation))
    elif num == 0:
        coords = torch.zeros((0, 4), dtype=torch.int32)
        plan = build_plan(coords, shape, 1, ConvGeometry.submanifold_conv(kernel, dilation))
    else:
        coords, plan = submanifold_case(num, shape, kernel, dilation, batch, seed=len(case))
    n = coords.shape[0]
    feats, weight, b = make_inputs(n, ci, co, (kernel,) * 3, torch.float32, device, 9, bias)
    grad_out = torch.randn(n, co, generator=torch.Generator().manual_seed(10))
    got = run_and_grads(feats, plan.to(device), weight, b, algo, False, grad_out.to(device))
    ref = reference_and_grads(
        lambda f, w, bb: dense_submconv(f, coords, shape, batch, w, bb, (dilation,) * 3),
        feats, weight, b, grad_out)
    assert got[0].shape == (n, co)
    if n == 0:
        assert got[2].abs().max() == 0  # no voxels, no weight gradient
        return
    check_all(got, ref, 2e-5, f"{case}/{algo}")


@pytest.mark.parametrize("config", [(16, 16, 16, 1), (32, 32, 64, 3), (64, 16, 32, 2),
                                    (16, 64, 128, 1), (16, 32, 64, 32)])
@pytest.mark.parametrize("algo", ["implicit_splitk", "masked_splitk"])
def test_forced_configs(config, algo, device, monkeypatch):
    """Block shapes that put K-chunks inside one offset (K % BLOCK_K == 0) or across offsets,
    with and without split-K, and more splits than a block has iterations (empty splits), every
    part: all equal the gather reference. The last: 32 splits of at most 9 iterations in the
    forward and grad-input (one K-chunk per offset), and of fewer pairs than splits for every
    offset but the centre in grad-weight; its BLOCK_N of 32 (one Ci tile) halves its grad-weight
    grid (Co x Ci tiles, V, 32), each program of it a round through the interpreter. Several
    channel tiles under split-K: (64, 16, 32, 2).

    A 3x3x1 kernel (V = 9: a third of the programs and iterations of 3x3x3; the kernels take V
    as an argument, and 3x3x3 runs under the default configs in every other test here), and
    ~45 voxels (3 row tiles) where BLOCK_M is 16, ~110 (2 to 7 row tiles) otherwise: several
    row tiles under every config.

    Grad-weight is one launch whatever the algorithm once its config is forced (the algorithm
    only picks the config, and the split ones do not take explicit's path): it runs, and is
    checked, under masked_splitk only."""
    import importlib

    from flexplan.kernel_configs import KernelConfig

    ops_module = importlib.import_module("flexplan.ops.conv")
    monkeypatch.setattr(ops_module, "select_config", lambda family, problem: KernelConfig(*config))
    kernel = (3, 3, 1)
    coords, plan = submanifold_case(45 if config[0] == 16 else 110, kernel_size=kernel,
                                    seed=config[2] + config[3])
    assert -(-coords.shape[0] // config[0]) >= 2  # several row tiles
    v = plan.geometry.volume
    feats, weight, bias = make_inputs(coords.shape[0], 32, 16, kernel, torch.float32, device, 8)
    wgrad = algo == "masked_splitk"
    weight.requires_grad_(wgrad)
    grad_out = torch.randn(coords.shape[0], 16, generator=torch.Generator().manual_seed(9))
    got = run_and_grads(feats, plan.to(device), weight, bias, algo, False, grad_out.to(device))
    nmap = plan.fwd.neighbor_map
    ref = reference_and_grads(lambda f, w, b: gather_conv(f, nmap, w.reshape(16, v, 32), b),
                              feats, weight, bias, grad_out)
    names = ("out", "grad_feats") + (("grad_weight",) if wgrad else ()) + ("grad_bias",)
    check_all(got, ref, 2e-5, f"{config}/{algo}", names)


@pytest.mark.parametrize("dtype_name", ["float64", "float16"])
def test_explicit_in_chunks(dtype_name, device, monkeypatch):
    """The explicit algorithm with a workspace of a few rows: chunked im2col, every part
    (grad-weight sums its chunks) equals the gather reference."""
    import importlib

    ops_module = importlib.import_module("flexplan.ops.conv")
    dtype, _, tol = DTYPES[dtype_name]
    ci, co = 6, 5
    monkeypatch.setattr(ops_module, "EXPLICIT_WORKSPACE_BYTES", 7 * 27 * ci * dtype.itemsize)
    coords, plan = submanifold_case(100, seed=21)
    feats, weight, bias = make_inputs(coords.shape[0], ci, co, (3, 3, 3), dtype, device, 22)
    grad_out = torch.randn(coords.shape[0], co, generator=torch.Generator().manual_seed(23))
    got = run_and_grads(feats, plan.to(device), weight, bias, "explicit", False,
                        grad_out.to(dtype).to(device))
    nmap = plan.fwd.neighbor_map
    ref = reference_and_grads(lambda f, w, b: gather_conv(f, nmap, w.reshape(co, 27, ci), b),
                              feats, weight, bias, grad_out.to(dtype))
    check_all(got, ref, tol, f"explicit in chunks/{dtype_name}")


def test_sorted_map_t_is_the_map_in_gray_order_transposed():
    _, plan = submanifold_case(90, seed=31)
    gmap = plan.fwd
    nmap, order = gmap.neighbor_map, gmap.sorted_idx.long()
    assert sorted_map_t(gmap).shape == (nmap.shape[1], nmap.shape[0])
    assert torch.equal(sorted_map_t(gmap), nmap[order].t())
    assert sorted_map_t(gmap) is sorted_map_t(gmap)  # derived once per plan object
    assert not any("sorted_map_t" in name for name in plan.tensors())  # not in plan files


def test_auto_picks_explicit_for_wide_16bit_only():
    from flexplan.kernel_configs import EXPLICIT_MIN_CHANNELS, choose_algo

    wide = EXPLICIT_MIN_CHANNELS
    for dtype in ("float16", "bfloat16"):
        assert choose_algo("fwd", 5000, wide, wide, 27, dtype) == "explicit"
        assert choose_algo("dgrad", 5000, wide, wide, 27, dtype) == "explicit"
        assert choose_algo("wgrad", 5000 * 27, wide, wide, 27, dtype) != "explicit"
        assert choose_algo("fwd", 5000, wide // 2, wide, 27, dtype) != "explicit"
    for dtype in ("float32", "tf32", "float64"):  # explicit's matmul follows torch's TF32 flag
        assert choose_algo("fwd", 5000, wide, wide, 27, dtype) != "explicit"


# ------------------------------------------------------------------ errors

def test_clear_errors():
    coords, plan = submanifold_case(50)
    n = coords.shape[0]
    feats = torch.randn(n, 4)
    weight = torch.randn(6, 3, 3, 3, 4)
    with pytest.raises(ValueError, match="channels"):
        sparse_conv(torch.randn(n, 5), plan, weight)
    with pytest.raises(TypeError, match="dtype"):
        sparse_conv(feats.double(), plan, weight)
    with pytest.raises(ValueError, match="kernel size"):
        sparse_conv(feats, plan, torch.randn(6, 5, 5, 5, 4))
    with pytest.raises(ValueError, match="shape"):
        sparse_conv(feats, plan, torch.randn(6, 27, 4))
    with pytest.raises(ValueError, match="rows"):
        sparse_conv(feats[:-1], plan, weight)
    with pytest.raises(ValueError, match="plan is on"):
        sparse_conv(feats, plan.to("meta"), weight)
    with pytest.raises(ValueError, match="bias"):
        sparse_conv(feats, plan, weight, torch.randn(5))
    with pytest.raises(ValueError, match="algorithm"):
        sparse_conv(feats, plan, weight, algo="fastest")
    with pytest.raises(TypeError, match="float16"):
        sparse_conv(feats.to(torch.int32), plan, weight)


# ------------------------------------------------------------------ module

def test_submconv3d_layers_share_one_plan(device):
    coords, _ = submanifold_case(150, seed=21)
    x = SparseTensor(torch.randn(coords.shape[0], 4, device=device), coords.to(device), (8, 8, 8))
    torch.manual_seed(0)
    net = torch.nn.ModuleList([SubMConv3d(4, 8, 3, algo="masked"), SubMConv3d(8, 3, 3, algo="auto")])
    net = net.to(device)
    y = net[1](net[0](x))
    assert len(x._plans) == 1, "both layers must reuse the plan of their shared geometry"
    plan = next(iter(x._plans.values()))
    ref = sparse_conv(sparse_conv(x.feats, plan, net[0].weight, net[0].bias, "explicit"),
                      plan, net[1].weight, net[1].bias, "explicit")
    assert rel_err(y.feats.detach().cpu(), ref.detach().double().cpu()) < 2e-5
    y.feats.square().sum().backward()
    assert net[0].weight.grad is not None and net[0].weight.grad.abs().sum() > 0
    with pytest.raises(TypeError, match="SparseTensor"):
        net[0](x.feats)


# ------------------------------------------------------------------ GPU, real sizes

@pytest.mark.gpu
@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16", "float32", "tf32"])
@pytest.mark.parametrize("algo", ALGOS)
def test_gpu_sphere_shell(algo, dtype_name):
    dtype, tf32, tol = DTYPES[dtype_name]
    device = torch.device("cuda")
    coords = sphere_shell(64, 2, device)
    # The torch planner: this test is about the kernels (the planners are tested for equality).
    plan = build_plan(coords, (64, 64, 64), 2, ConvGeometry.submanifold_conv(3), backend="torch")
    n = coords.shape[0]
    feats, weight, bias = make_inputs(n, 48, 80, (3, 3, 3), dtype, device, seed=1)
    grad_out = torch.randn(n, 80, generator=torch.Generator().manual_seed(2)).to(dtype)
    got = run_and_grads(feats, plan, weight, bias, algo, tf32, grad_out.to(device))
    nmap = plan.fwd.neighbor_map
    leaves = [t.detach().double().requires_grad_() for t in (feats, weight, bias)]
    out = gather_conv(leaves[0], nmap, leaves[1].reshape(80, 27, 48), leaves[2])
    ref = (out.detach(), *torch.autograd.grad(out, leaves, grad_out.double().to(device)))
    for name, g, r in zip(("out", "grad_feats", "grad_weight", "grad_bias"), got, ref):
        err = rel_err(g.detach(), r.detach())
        assert err <= tol, f"{algo}/{dtype_name}: {name} relative error {err:.3g} > {tol:g}"


@pytest.mark.parametrize("algo", ["masked", "implicit"])
def test_chunks_run_out_of_order(algo, device, monkeypatch):
    """Several chunks of sorted rows, run in plan_views.chunk_order (not the identity here: the
    spatial order that big maps take, forced for this small one)."""
    monkeypatch.setattr(plan_views, "CHUNK_ORDER_MIN_ROWS", 0)
    shape = (10, 10, 10)
    coords, plan = submanifold_case(420, shape, seed=5)
    chunk = SCHEDULE_CHUNK
    order = chunk_order(plan.fwd).tolist()
    firsts = plan.fwd.sorted_idx[::chunk].tolist()
    assert sorted(order) == list(range(len(order))) and order != sorted(order)
    assert [firsts[c] for c in order[:-1]] == sorted(firsts[:-1]) and order[-1] == len(order) - 1
    n = coords.shape[0]
    feats, weight, b = make_inputs(n, 5, 6, (3, 3, 3), torch.float32, device, 3)
    grad_out = torch.randn(n, 6, generator=torch.Generator().manual_seed(4))
    got = run_and_grads(feats, plan.to(device), weight, b, algo, False, grad_out.to(device))
    ref = reference_and_grads(lambda f, w, bb: dense_submconv(f, coords, shape, 1, w, bb, (1, 1, 1)),
                              feats, weight, b, grad_out)
    check_all(got, ref, 2e-5, algo)


@pytest.mark.parametrize("splits", [2, 5])
def test_split_k_sums_in_the_kernel_and_leaves_its_counters_zeroed(splits, device, monkeypatch):
    """Split-K in one launch (kernels_src/conv_common.py, split_tile_ticket): the last split of
    each tile sums the fp32 partials, adds the bias and casts. Forward with bias in float16 and
    grad-weight stored as float32 from float16 features (an fp32 master weight under autocast),
    against float64 references, twice in a row: the counters the first launches used serve the
    second (they are left zeroed: a counter left raised would skip tiles, leaving NaN)."""
    import importlib

    from flexplan.kernel_configs import KernelConfig

    ops_module = importlib.import_module("flexplan.ops.conv")
    monkeypatch.setattr(ops_module, "select_config",
                        lambda family, problem: KernelConfig(16, 16, 16, splits))
    monkeypatch.setattr(ops_module, "_tile_counts", {})
    coords, plan = submanifold_case(70, seed=splits)
    plan = plan.to(device)
    gen = torch.Generator().manual_seed(40 + splits)
    m, ci, co = coords.shape[0], 24, 20
    feats = torch.randn(m, ci, generator=gen).half()
    weight = torch.randn(co, 27, ci, generator=gen).half()
    bias = torch.randn(co, generator=gen).half()
    grad_out = torch.randn(m, co, generator=gen).half()
    nmap = plan.fwd.neighbor_map.cpu()
    ref_out = gather_conv(feats.double(), nmap, weight.double(), bias.double())
    cols = feats.double()[nmap.clamp(min=0).long()] * (nmap >= 0)[..., None]  # [m, V, Ci]
    ref_wgrad = torch.einsum("mo,mvc->ovc", grad_out.double(), cols)
    feats, weight, bias, grad_out = (t.to(device) for t in (feats, weight, bias, grad_out))
    for _ in range(2):
        out = ops_module.gather_gemm(feats, weight, bias, plan.fwd, False, "fwd", "masked_splitk",
                                     False)
        grad_w = ops_module.wgrad(grad_out, feats, plan, weight.shape, "masked_splitk", False,
                                  out_dtype=torch.float32)
        assert out.dtype == torch.float16 and grad_w.dtype == torch.float32
        assert rel_err(out.cpu(), ref_out) < 3e-3
        assert rel_err(grad_w.cpu(), ref_wgrad) < 1e-5
    counters = list(ops_module._tile_counts.values())
    assert counters and all(int(c.abs().sum()) == 0 for c in counters)


def test_a_maps_launch_is_resolved_once_while_dispatch_holds(device, monkeypatch):
    """gather_gemm keeps what a launch takes from the map and dispatch (GatherMap.launch_memo):
    a second call of the same shape on the map asks dispatch nothing; new answers (tables
    reset: a new epoch) are asked for again, and a config forced by the tuner is never kept."""
    import importlib

    from flexplan.kernel_configs import KernelConfig
    from flexplan.tuning import dispatch

    conv_module = importlib.import_module("flexplan.ops.conv")
    asked = []
    real = conv_module.select_config
    monkeypatch.setattr(conv_module, "select_config",
                        lambda family, problem: asked.append(problem) or real(family, problem))
    coords, plan = submanifold_case(70, seed=41)
    plan = plan.to(device)
    feats, weight, bias = make_inputs(coords.shape[0], 16, 16, (3, 3, 3), torch.float32, device, 42)
    ref = sparse_conv(feats, plan, weight, bias, algo="masked")
    assert len(asked) == 1
    assert torch.equal(sparse_conv(feats, plan, weight, bias, algo="masked"), ref)
    assert len(asked) == 1  # from the map's memo
    dispatch.reset()
    sparse_conv(feats, plan, weight, bias, algo="masked")
    assert len(asked) == 2  # a new epoch: asked again
    with dispatch.forced_config(KernelConfig(16, 16, 16, 1, 4, 2)):
        forced = sparse_conv(feats, plan, weight, bias, algo="masked")
    assert len(asked) == 3 and (forced - ref).abs().max() <= 1e-4 * ref.abs().max()
    sparse_conv(feats, plan, weight, bias, algo="masked")
    assert len(asked) == 3  # the forced config was not kept; the epoch's answer was


def test_a_shapes_config_is_kept_across_plans(device, monkeypatch):
    """A fresh plan's convolutions (forward, grad-input, grad-weight) of a shape seen before
    ask dispatch nothing (ops.conv.shape_config), and compute what a fresh process computes;
    a new epoch asks again."""
    import importlib

    from flexplan.tuning import dispatch

    conv_module = importlib.import_module("flexplan.ops.conv")
    asked = []
    real = conv_module.select_config
    monkeypatch.setattr(conv_module, "select_config",
                        lambda family, problem: asked.append(problem) or real(family, problem))
    dispatch.reset()

    def train_call(seed):  # a plan built afresh each call (maps with empty memos)
        coords, plan = submanifold_case(70, seed=51)
        plan = plan.to(device)
        feats, weight, bias = make_inputs(coords.shape[0], 16, 16, (3, 3, 3), torch.float32,
                                          device, seed + 1)
        feats.requires_grad_(True)
        weight.requires_grad_(True)
        out = sparse_conv(feats, plan, weight, bias, algo="masked")
        out.backward(torch.ones_like(out))
        return out, feats.grad, weight.grad

    train_call(51)
    shapes = len(asked)
    assert shapes == 3  # forward, grad-input, grad-weight
    second = train_call(53)
    assert len(asked) == shapes  # a new map, the same shapes: kept
    conv_module._shape_configs.clear()
    again = train_call(53)
    assert len(asked) == 2 * shapes
    for kept, fresh in zip(second, again):
        assert torch.equal(kept, fresh)
    dispatch.reset()
    train_call(53)
    assert len(asked) == 3 * shapes  # a new epoch: asked again


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("geometry", ["submanifold", "strided"])
def test_dgrad_reads_weight_as_stored(geometry, dtype, device, monkeypatch):
    """16-bit grad-input reads the weight [Co, V, Ci] as it is stored (WEIGHT_KVN): the same
    bits as over its transposed copy (ops.conv.DGRAD_WEIGHT_COPY, the former path: the
    kernel's loop and sums are the same, only the weight's addresses differ), Ci and Co unequal
    and not multiples of 16; reversed offsets (submanifold) and a strided plan's bwd map.
    float32 keeps the copy on GPUs (its tf32 tiles); here both of its paths run too."""
    import importlib

    ops_module = importlib.import_module("flexplan.ops.conv")
    name = str(dtype).removeprefix("torch.")
    if dtype == torch.float32 and device.type == "cpu":  # (the interpreter reads either)
        monkeypatch.setattr(ops_module, "WEIGHT_KVN_DTYPES", frozenset({name}))
    ci, co = 5, 19
    if geometry == "submanifold":
        coords, plan = submanifold_case(70, seed=21)
    else:
        coords = random_coords(70, (8, 8, 8), 1, generator=torch.Generator().manual_seed(22))
        plan = build_plan(coords, (8, 8, 8), 1,
                          ConvGeometry.make(3, stride=2, padding=1, submanifold=False))
    plan = plan.to(device)
    gen = torch.Generator().manual_seed(23)
    weight = torch.randn(co, 27, ci, generator=gen).to(dtype).to(device)
    grad_out = torch.randn(plan.num_out, co, generator=gen).to(dtype).to(device)
    grads = []
    for copy in (False, True):
        monkeypatch.setattr(ops_module, "DGRAD_WEIGHT_COPY", copy)
        assert ops_module.reads_weight_kvn("dgrad", name) is (
            not copy and name in ops_module.WEIGHT_KVN_DTYPES)
        grads.append(ops_module.conv_dgrad(grad_out, weight, plan, "masked", False))
    assert grads[0].shape == (plan.num_in, ci)
    assert grads[0].float().abs().max() > 0
    assert torch.equal(grads[0], grads[1])
    # (and right: the forward's float64 gradient)
    feats = torch.zeros(plan.num_in, ci, dtype=torch.float64, requires_grad=True)
    out = gather_conv(feats, plan.fwd.neighbor_map.cpu(), weight.double().cpu(), None)
    ref, = torch.autograd.grad(out, feats, grad_out.double().cpu())
    torch.testing.assert_close(grads[0].double().cpu(), ref, rtol=1e-2 if name == "float16"
                               else 1e-5, atol=1e-2 if name == "float16" else 1e-5)
