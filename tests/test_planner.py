"""Planner: the Triton hash-table planner equals the torch planner exactly, and every plan
satisfies the invariants the kernels rely on (checked against plain-Python references)."""
import pytest
import torch

from flexplan import ConvGeometry, build_plan
from flexplan.kernel_configs import PLAN_BLOCK_SIZES
from flexplan.plan import MISSING
from flexplan.planner.hashmap import coords_problems, problem_rows, submanifold_neighbor_map_triton
from flexplan.planner.keys import key_dtype
from flexplan.planner.offsets import kernel_offsets
from flexplan.planner.reference import submanifold_neighbor_map_torch
from flexplan.planner import rank_sort
from flexplan.planner.segments import gather_map, gray_rank_words, valid_signal
from flexplan.sparse_tensor import SparseTensorError, check_coords
from flexplan.workloads import random_coords, sphere_shell

# (spatial_shape, batch, kernel_size, dilation, voxels drawn): sizes not multiples of blocks.
CASES = [
    ((10, 12, 9), 2, 3, 1, 300),
    ((11, 7, 9), 3, 3, 2, 150),
    ((9, 9, 9), 1, (3, 1, 3), 1, 250),
    ((6, 7, 6), 2, 5, (1, 2, 1), 170),
]
BIG_SHAPE, BIG_BATCH = (2048, 2048, 2048), 8  # 2^36 cells: 64-bit keys


def _coords(shape, batch, n, seed, device):
    return random_coords(n, shape, batch, generator=torch.Generator().manual_seed(seed),
                         device=device)


def _far_corner_coords(n, seed, device):
    """Dense-ish clump at the far corner of the 64-bit grid, so keys exceed 2^31."""
    clump = _coords((8, 8, 8), 2, n, seed, "cpu")
    offset = torch.tensor([BIG_BATCH - 2, *(s - 8 for s in BIG_SHAPE)], dtype=torch.int32)
    return (clump + offset).to(device)


def _plans_equal(a, b):
    ta, tb = a.tensors(), b.tensors()
    assert ta.keys() == tb.keys()
    for name in ta:
        assert torch.equal(ta[name].cpu(), tb[name].cpu()), name


def _neighbors_by_dict(coords, shape, geometry):
    """Plain-Python neighbour map: the definition, independent of both planners."""
    rows = {tuple(c): i for i, c in enumerate(coords.tolist())}
    offsets = kernel_offsets(geometry).tolist()
    out = []
    for b, x, y, z in coords.tolist():
        line = []
        for dx, dy, dz in offsets:
            p = (x + dx, y + dy, z + dz)
            inside = all(0 <= q < s for q, s in zip(p, shape))
            line.append(rows.get((b, *p), MISSING) if inside else MISSING)
        out.append(line)
    return torch.tensor(out, dtype=torch.int32).view(len(out), len(offsets))


def _gray_rank(mask_row):
    """Inverse Gray code of the mask read as an integer with offset V-1 most significant."""
    m = sum(1 << v for v, bit in enumerate(mask_row) if bit)
    rank, shifted = m, m >> 1
    while shifted:
        rank ^= shifted
        shifted >>= 1
    return rank


def _check_schedule(nmap, gmap, signal):
    """Gray order, valid_kernel and valid_signal against plain-Python references."""
    nmap = nmap.cpu()
    m, v = nmap.shape
    present = (nmap != MISSING).tolist()
    ranks = [_gray_rank(row) for row in present]
    order = gmap.sorted_idx.cpu().tolist()
    assert sorted(order) == list(range(m))                                   # a permutation
    assert order == sorted(range(m), key=lambda i: (ranks[i], i))            # stable Gray order
    for block in PLAN_BLOCK_SIZES:
        kernel, seg = gmap.valid_kernel[block].cpu().tolist(), gmap.valid_kernel_seg[block].cpu().tolist()
        n_blocks = -(-m // block)
        assert len(seg) == n_blocks + 1 and seg[0] == 0
        for k in range(n_blocks):
            rows = order[k * block:(k + 1) * block]
            union = sorted({o for r in rows for o in range(v) if present[r][o]})
            assert kernel[seg[k]:seg[k + 1]] == union, (block, k)
        assert seg[-1] == len(kernel)
    sig_i, sig_o, sig_seg = (t.cpu().tolist() for t in signal)
    offsets = len(sig_seg) - 1  # the pairs of the first `offsets` offsets
    pairs = [(nmap[i, o].item(), i) for o in range(offsets) for i in range(m) if present[i][o]]
    assert list(zip(sig_i, sig_o)) == pairs
    counts = [sum(present[i][o] for i in range(m)) for o in range(offsets)]
    assert sig_seg == [sum(counts[:o]) for o in range(offsets + 1)]


@pytest.mark.parametrize("shape,batch,kernel,dilation,n", CASES)
def test_triton_plan_equals_torch_plan(shape, batch, kernel, dilation, n, device):
    coords = _coords(shape, batch, n, seed=sum(shape) + batch, device=device)
    geometry = ConvGeometry.make(kernel, dilation)
    triton_plan = build_plan(coords, shape, batch, geometry, backend="triton")
    _plans_equal(triton_plan, build_plan(coords, shape, batch, geometry, backend="torch"))
    for name, t in triton_plan.tensors().items():  # kernels specialize on 16-byte alignment
        assert t.data_ptr() % 16 == 0, name
    assert torch.equal(triton_plan.fwd.neighbor_map.cpu(),
                       _neighbors_by_dict(coords.cpu(), shape, geometry))


def test_64bit_keys(device):
    assert key_dtype(BIG_SHAPE, BIG_BATCH) == torch.int64
    coords = _far_corner_coords(200, seed=3, device=device)
    geometry = ConvGeometry.make(3)
    nmap, problems = submanifold_neighbor_map_triton(coords, BIG_SHAPE, BIG_BATCH, geometry)
    assert problem_rows(problems.tolist(), coords.shape[0]) == [coords.shape[0]] * 2
    assert torch.equal(nmap, submanifold_neighbor_map_torch(coords, BIG_SHAPE, BIG_BATCH, geometry))
    assert torch.equal(nmap.cpu(), _neighbors_by_dict(coords.cpu(), BIG_SHAPE, geometry))
    assert (nmap != MISSING).sum() > 3 * coords.shape[0]  # the clump really has neighbours


@pytest.mark.parametrize("shape,batch,kernel,dilation,n", CASES[:2] + CASES[3:])
def test_plan_invariants(shape, batch, kernel, dilation, n, device):
    coords = _coords(shape, batch, n, seed=7, device=device)
    plan = build_plan(coords, shape, batch, ConvGeometry.make(kernel, dilation), backend="triton")
    nmap = plan.fwd.neighbor_map.cpu()
    m, v = nmap.shape
    rows = torch.arange(m, dtype=torch.int32)
    assert torch.equal(nmap[:, v // 2], rows)                                # centre is itself
    i, o = (nmap != MISSING).nonzero(as_tuple=True)                          # symmetry
    assert torch.equal(nmap[nmap[i, o].long(), v - 1 - o], i.to(torch.int32))
    signal = (plan.valid_signal_i, plan.valid_signal_o, plan.valid_signal_seg)
    _check_schedule(nmap, plan.fwd, signal)
    # The kept pairs stop at the centre; with their mirrors they are every pair of the map.
    assert plan.signal_offsets == v // 2 + 1
    assert plan.num_pairs == int((nmap != MISSING).sum())


def _random_map(volume: int, m: int, device) -> torch.Tensor:
    """A non-symmetric map (as strided plans have): random rows and MISSING pattern."""
    g = torch.Generator().manual_seed(volume)
    nmap = torch.randint(0, 40, (m, volume), generator=g, dtype=torch.int32)
    nmap[torch.rand(m, volume, generator=g) < 0.6] = MISSING
    nmap[:5] = MISSING                                                       # empty rows too
    return nmap.to(device)


def _assert_schedule_backends_agree(nmap):
    volume = nmap.shape[1]
    gmaps = {b: gather_map(nmap, PLAN_BLOCK_SIZES, backend=b) for b in ("torch", "triton")}
    signals = {b: valid_signal(nmap, backend=b) for b in ("torch", "triton")}
    for a, b in zip(signals["torch"], signals["triton"]):
        assert torch.equal(a, b)
    for a, b in zip(valid_signal(nmap, "torch", volume // 2 + 1),
                    valid_signal(nmap, "triton", volume // 2 + 1)):
        assert torch.equal(a, b)
    ga, gb = gmaps["torch"], gmaps["triton"]
    assert torch.equal(ga.sorted_idx, gb.sorted_idx)
    for block in PLAN_BLOCK_SIZES:
        assert torch.equal(ga.valid_kernel[block], gb.valid_kernel[block])
        assert torch.equal(ga.valid_kernel_seg[block], gb.valid_kernel_seg[block])
    _check_schedule(nmap, gb, signals["triton"])


# volumes: one int32, one int64, two int64 rank words; 1100 rows: block sizes meet mid-program
@pytest.mark.parametrize("volume,m", [(27, 157), (45, 157), (125, 157), (27, 1100)])
def test_schedule_backends_agree_on_any_map(volume, m, device):
    _assert_schedule_backends_agree(_random_map(volume, m, device))


def test_rank_sort_buckets():
    """Captured sorts serve buckets of row counts: at most 1/4 more keys than rows."""
    low, high = rank_sort.MIN_ROWS, rank_sort.MAX_ROWS
    for rows in [low, low + 1, 9000, 331328, high - 1, high]:
        size = rank_sort.bucket(rows)
        assert rows <= size <= rows * 5 // 4 and rank_sort.bucket(size) == size
    assert rank_sort.bucket(8193) == rank_sort.bucket(10240) == 10240


def test_gray_rank_kernel_pads_the_keys(device):
    """Ranks padded to a sort's fixed size: the padding holds the largest word, what lies
    past it is untouched, and the ranks equal the torch path's."""
    from flexplan.kernels_src import plan_segments
    from flexplan.launch_spec import UNREAD_ADDRESS
    from flexplan.launcher import launch
    from flexplan.planner.segments_triton import GRAY_RANK_LAUNCH, ROW_BLOCK

    m, padded, volume = 157, 170, 27
    nmap = _random_map(volume, m, device)
    keys = torch.full((200,), 7, dtype=torch.int32, device=device)
    counts = torch.empty(volume * -(-m // ROW_BLOCK), dtype=torch.int32, device=device)
    launch(plan_segments.gray_rank_kernel, (-(-m // ROW_BLOCK),), nmap, keys, counts, m,
           UNREAD_ADDRESS, volume, padded, V=volume, WORDS=1, WORD_BITS=32, **GRAY_RANK_LAUNCH)
    assert torch.equal(keys[:m], gray_rank_words(nmap != MISSING)[0])
    assert (keys[m:padded] == 2**31 - 1).all() and (keys[padded:] == 7).all()


def test_schedule_with_an_int64_scan(monkeypatch, device):
    """Maps whose counts could sum past 2^31 get an int64 scan (forced here): same schedule."""
    from flexplan.planner import segments_triton

    used = []
    monkeypatch.setattr(segments_triton, "scan_dtype", lambda bound: used.append(bound) or torch.int64)
    _assert_schedule_backends_agree(_random_map(27, 300, device))
    assert used


def test_schedule_with_many_tiles(monkeypatch, device):
    """Small schedule tiles (forced here): both look-backs (chunks of rows, pair entries) span
    several windows of tiles; same schedule."""
    from flexplan.planner import segments_triton

    monkeypatch.setattr(segments_triton, "SCHEDULE_LAUNCH", dict(ROWS=max(PLAN_BLOCK_SIZES),
                                                                 PAIR_TILE=16, LOOK_BACK=8, num_warps=4))
    nmap = _random_map(27, 1200, device)
    layout = segments_triton.schedule_layout(nmap.shape[0], 27, PLAN_BLOCK_SIZES, 27)
    chunks, tiles = layout.chunks, layout.tiles
    assert chunks > 8 and tiles - chunks > 2 * 8
    _assert_schedule_backends_agree(nmap)


@pytest.mark.parametrize("n", [0, 1])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_tiny_inputs(n, backend, device):
    coords = torch.tensor([[0, 2, 3, 4]], dtype=torch.int32, device=device)[:n]
    plan = build_plan(coords, (5, 6, 7), 1, ConvGeometry.make(3), backend=backend)
    nmap = plan.fwd.neighbor_map
    assert nmap.shape == (n, 27) and nmap.dtype == torch.int32
    expected = torch.full((n, 27), MISSING, dtype=torch.int32)
    expected[:, 13] = 0
    assert torch.equal(nmap.cpu(), expected)
    assert plan.fwd.sorted_idx.tolist() == list(range(n))
    assert plan.num_pairs == n
    for block in PLAN_BLOCK_SIZES:
        assert plan.fwd.valid_kernel[block].tolist() == ([13] if n else [])
        assert plan.fwd.valid_kernel_seg[block].tolist() == ([0, 1] if n else [0])


def test_one_voxel_kernel(device):
    coords = _coords((4, 4, 4), 1, 20, seed=1, device=device)
    nmap, _ = submanifold_neighbor_map_triton(coords, (4, 4, 4), 1, ConvGeometry.make(1))
    assert torch.equal(nmap.cpu().view(-1), torch.arange(coords.shape[0], dtype=torch.int32))


@pytest.mark.parametrize("shape,batch", [((9, 9, 9), 2), (BIG_SHAPE, BIG_BATCH)])
def test_hash_insert_finds_problems(shape, batch, device):
    coords = _far_corner_coords(60, 5, device) if batch == BIG_BATCH else \
        _coords(shape, batch, 60, seed=5, device=device)
    n = coords.shape[0]
    assert coords_problems(coords, shape, batch) == [n, n]
    repeated = torch.cat([coords[:4], coords[2:3], coords[4:]])
    assert coords_problems(repeated, shape, batch)[1] in (2, 4)
    outside = coords.clone()
    outside[[7, 9], 0] = batch                                               # batch too large
    outside[12, 3] = -1
    assert coords_problems(outside, shape, batch)[0] == 7


def _message(fn):
    with pytest.raises(SparseTensorError) as info:
        fn()
    return str(info.value)


@pytest.mark.parametrize("shape,batch", [((9, 9, 9), 2), (BIG_SHAPE, BIG_BATCH)])
@pytest.mark.parametrize("problem", ["duplicate", "batch", "negative", "edge"])
def test_checked_triton_build_raises_like_check_coords(shape, batch, problem, device):
    """The Triton build checks within its hash inserts; the errors are check_coords' own."""
    coords = _far_corner_coords(60, 5, "cpu") if batch == BIG_BATCH else \
        _coords(shape, batch, 60, seed=5, device="cpu")
    if problem == "duplicate":
        coords = torch.cat([coords[:30], coords[11:12], coords[30:]])
    elif problem == "batch":
        coords[[17, 40], 0] = batch
    elif problem == "negative":  # its key would be -1, the empty-slot marker
        coords[17] = torch.tensor([-1, shape[0] - 1, shape[1] - 1, shape[2] - 1])
    else:
        coords[[23, 50], 2] = shape[1]
    coords = coords.to(device)
    expected = _message(lambda: check_coords(coords, shape, batch))
    assert expected.startswith("duplicate" if problem == "duplicate" else "coords row")
    for geometry in (ConvGeometry.make(3), ConvGeometry.make(1)):
        assert _message(lambda: build_plan(coords, shape, batch, geometry, backend="triton")) == expected
    build_plan(coords, shape, batch, ConvGeometry.make(3), backend="triton", check=False)  # no crash


@pytest.mark.parametrize("check, training, syncs", [
    (True, True, 1), (True, False, 1), (False, True, 0), (False, False, 0)])
def test_triton_build_syncs(monkeypatch, device, check, training, syncs):
    """Every size the host needs, and the input checks, come back in one read; a build of
    coordinates checked before (check=False) needs none (its schedule's lengths stay on the
    device; a training build's pair count is read when asked: ConvPlan.pairs_pending) and
    still equals the torch planner's plan."""
    coords = _coords((10, 12, 9), 2, 120, seed=1, device=device)
    geometry = ConvGeometry.make(3)
    build = lambda: build_plan(coords, (10, 12, 9), 2, geometry, backend="triton", check=check,
                               training=training)
    build()  # warm up
    reads = []
    for name in ("tolist", "item", "__int__", "__bool__", "__index__", "cpu", "numpy"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _real=real, _name=name, **k:
                            reads.append(_name) or _real(self, *a, **k))
    plan = build()
    monkeypatch.undo()
    assert reads == ["tolist"] * syncs
    _plans_equal(plan, build_plan(coords, (10, 12, 9), 2, geometry, backend="torch",
                                  training=training))


def test_triton_schedule_block_sizes(device):
    """Any block sizes doubling from a power of two; others are refused."""
    nmap = _neighbors_by_dict(_coords((6, 6, 6), 1, 90, seed=2, device="cpu"), (6, 6, 6),
                              ConvGeometry.make(3)).to(device)
    for sizes in [(32,), (8, 16), (256, 64, 128)]:
        ga, gb = gather_map(nmap, sizes, backend="torch"), gather_map(nmap, sizes, backend="triton")
        assert torch.equal(ga.sorted_idx, gb.sorted_idx)
        for block in sizes:
            assert torch.equal(ga.valid_kernel[block], gb.valid_kernel[block])
            assert torch.equal(ga.valid_kernel_seg[block], gb.valid_kernel_seg[block])
    for sizes in [(16, 48), (16, 64), (24, 48)]:
        with pytest.raises(ValueError, match="doubling"):
            gather_map(nmap, sizes, backend="triton")


def test_unknown_backend():
    coords = torch.zeros((1, 4), dtype=torch.int32)
    with pytest.raises(ValueError, match="backend"):
        build_plan(coords, (4, 4, 4), 1, ConvGeometry.make(3), backend="cuda")
    with pytest.raises(ValueError, match="backend"):
        valid_signal(torch.zeros((1, 27), dtype=torch.int32), backend="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("resolution,batch", [(256, 2), (512, 1)])
def test_triton_plan_equals_torch_plan_gpu(resolution, batch):
    coords = sphere_shell(resolution, batch, device="cuda")
    shape = (resolution,) * 3
    for geometry in (ConvGeometry.make(3), ConvGeometry.make((3, 1, 3), 2)):
        _plans_equal(build_plan(coords, shape, batch, geometry, backend="triton"),
                     build_plan(coords, shape, batch, geometry, backend="torch"))


@pytest.mark.gpu
def test_schedule_backends_agree_gpu():
    """The schedule alone and valid_signal alone (no block sizes) on a GPU, with real
    concurrency across several look-back windows of tiles: equal to the torch path."""
    coords = sphere_shell(128, 1, device="cuda")
    _assert_schedule_backends_agree(build_plan(coords, (128,) * 3, 1, ConvGeometry.make(3)).fwd.neighbor_map)


@pytest.mark.gpu
def test_64bit_keys_gpu():
    coords = sphere_shell(256, 1, device="cuda")
    coords[:, 0] = BIG_BATCH - 1
    coords[:, 1:] += 2048 - 256
    geometry = ConvGeometry.make(3)
    _plans_equal(build_plan(coords, BIG_SHAPE, BIG_BATCH, geometry, backend="triton"),
                 build_plan(coords, BIG_SHAPE, BIG_BATCH, geometry, backend="torch"))


@pytest.mark.gpu
def test_duplicates_rejected_on_gpu():
    from flexplan.sparse_tensor import SparseTensorError

    coords = sphere_shell(128, 1, device="cuda")
    dup = torch.cat([coords, coords[1234:1235]])
    with pytest.raises(SparseTensorError, match="rows 1234 and"):
        build_plan(dup, (128,) * 3, 1, ConvGeometry.make(3))


@pytest.mark.gpu
def test_captured_rank_sort_gpu(monkeypatch):
    """Small schedules sort through a graph captured at a bucket's second request: two row
    counts of one bucket in turn (the second must not read the first one's keys past its
    rows), on two streams; none past the budget of keys, none inside the caller's capture, none
    with FLEXPLAN_SORT_GRAPHS=0."""
    def sorter(rows=9000):
        return rank_sort.rank_sorter(rows, 1, torch.int32, torch.device("cuda", 0))

    rank_sort.release()
    assert isinstance(sorter(), rank_sort.TorchSort)  # the first request
    assert isinstance(sorter(), rank_sort.CapturedSort)
    for m in (9000, 8300):  # one bucket: 10240 keys
        _assert_schedule_backends_agree(_random_map(27, m, "cuda"))
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        sorter()
        assert isinstance(sorter(), rank_sort.CapturedSort)
        _assert_schedule_backends_agree(_random_map(27, 8700, "cuda"))
    torch.cuda.synchronize()
    graph, touched = torch.cuda.CUDAGraph(), torch.zeros(1, device="cuda")
    with torch.cuda.graph(graph):
        assert isinstance(sorter(), rank_sort.TorchSort)
        touched.add_(1)  # (a graph with work in it)
    monkeypatch.setattr(rank_sort, "KEYS_BUDGET", 3 * 10240)
    assert all(isinstance(sorter(20000), rank_sort.TorchSort) for _ in range(3))  # 20480 more keys
    monkeypatch.setenv(rank_sort.SORT_GRAPHS_ENV, "0")
    assert all(isinstance(sorter(5000), rank_sort.TorchSort) for _ in range(3))  # (5120 keys)
    rank_sort.release()
