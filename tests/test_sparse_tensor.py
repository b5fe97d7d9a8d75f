"""SparseTensor and check_coords: every malformed input raises a clear SparseTensorError."""
import pytest
import torch

from flexplan.sparse_tensor import SparseTensor, SparseTensorError, check_coords

SHAPE = (5, 6, 7)


def _coords(device="cpu"):
    return torch.tensor([[0, 0, 0, 0], [0, 4, 5, 6], [1, 2, 3, 4], [1, 2, 3, 5]],
                        dtype=torch.int32, device=device)


def _feats(n=4, c=3, device="cpu"):
    return torch.randn(n, c, generator=torch.Generator().manual_seed(n), dtype=torch.float64).to(device)


def test_valid_tensor(device):
    st = SparseTensor(_feats(device=device), _coords(device), SHAPE)
    assert st.batch_size == 2 and st.num_voxels == 4 and st.num_channels == 3
    assert st.spatial_shape == SHAPE and st.device.type == device.type


@pytest.mark.parametrize("coords,match", [
    (_coords().long(), "int32"),
    (_coords().float(), "int32"),
    (_coords()[:, :3], r"\[N, 4\]"),
    (_coords().view(-1), r"\[N, 4\]"),
    ([[0, 0, 0, 0]], "torch.Tensor"),
])
def test_bad_coords_type_or_shape(coords, match):
    with pytest.raises(SparseTensorError, match=match):
        check_coords(coords, SHAPE, 2)


@pytest.mark.parametrize("row,col,value", [(2, 1, -1), (1, 2, 6), (3, 3, 7), (2, 0, 2), (0, 0, -3)])
def test_out_of_range_coords(row, col, value, device):
    coords = _coords()
    coords[row, col] = value
    with pytest.raises(SparseTensorError, match=f"coords row {row} .* is outside"):
        check_coords(coords.to(device), SHAPE, 2)
    with pytest.raises(SparseTensorError, match="outside"):
        SparseTensor(_feats(device=device), coords.to(device), SHAPE, batch_size=2)


def test_duplicates_rejected_by_default(device):
    coords = torch.cat([_coords(), _coords()[2:3]]).to(device)
    with pytest.raises(SparseTensorError, match=r"duplicate coordinate \[1, 2, 3, 4\] at rows 2 and 4"):
        check_coords(coords, SHAPE, 2)
    with pytest.raises(SparseTensorError, match="merge_duplicates=True"):
        SparseTensor(_feats(5, device=device), coords, SHAPE)
    check_coords(coords, SHAPE, 2, check_duplicates=False)  # opt-out still checks the range


def test_merge_duplicates_sums_features(device):
    coords = torch.cat([_coords(), _coords()[2:3], _coords()[0:1]]).to(device)
    feats = _feats(6, device=device)
    st = SparseTensor(feats, coords, SHAPE, merge_duplicates=True)
    assert torch.equal(st.coords.cpu(), _coords())                  # first-occurrence order
    expected = feats[:4].clone()
    expected[2] += feats[4]
    expected[0] += feats[5]
    torch.testing.assert_close(st.feats, expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("feats,match", [
    (torch.ones(4, 3, dtype=torch.int32), "floating-point"),
    ("feats", "floating-point"),
    (torch.ones(4), r"\[N, C\]"),
    (torch.ones(5, 3), "feats has 5 rows but coords has 4"),
])
def test_bad_feats(feats, match):
    with pytest.raises(SparseTensorError, match=match):
        SparseTensor(feats, _coords(), SHAPE)


def test_bad_shape_and_batch():
    with pytest.raises(SparseTensorError, match="spatial_shape entries must be >= 1"):
        SparseTensor(_feats(), _coords(), (5, 0, 7))
    with pytest.raises(ValueError, match="3 entries"):
        SparseTensor(_feats(), _coords(), (5, 6))
    with pytest.raises(SparseTensorError, match="batch_size must be >= 1"):
        SparseTensor(_feats(), _coords(), SHAPE, batch_size=0)
    with pytest.raises(SparseTensorError, match="outside"):
        SparseTensor(_feats(), _coords(), SHAPE, batch_size=1)  # batch index 1 too large


@pytest.mark.gpu
def test_device_mismatch():
    with pytest.raises(SparseTensorError, match="cuda.* but coords is on cpu"):
        SparseTensor(_feats().cuda(), _coords(), SHAPE)


def test_empty_tensor(device):
    coords = torch.empty((0, 4), dtype=torch.int32, device=device)
    st = SparseTensor(torch.empty((0, 8), device=device), coords, SHAPE)
    assert st.batch_size == 1 and st.num_voxels == 0
    assert st.dense().shape == (1, 8, *SHAPE) and not st.dense().any()
    check_coords(coords, SHAPE, 1)


def test_dense(device):
    feats = _feats(device=device)
    st = SparseTensor(feats, _coords(device), SHAPE)
    dense = st.dense()
    assert dense.shape == (2, 3, *SHAPE)
    expected = torch.zeros(2, 3, *SHAPE, dtype=torch.float64)
    for f, (b, x, y, z) in zip(feats.cpu(), _coords().tolist()):
        expected[b, :, x, y, z] = f
    assert torch.equal(dense.cpu(), expected)


def test_replace_feats_checks_rows(device):
    st = SparseTensor(_feats(device=device), _coords(device), SHAPE)
    with pytest.raises(SparseTensorError, match=r"\[4, C\]"):
        st.replace_feats(_feats(3, device=device))
    assert st.replace_feats(_feats(4, 5, device=device)).num_channels == 5


def test_tensors_made_under_inference_mode(device):
    """An inference server's tensors (made under torch.inference_mode: no version counter) run
    like any others, 3D and 2D; their coordinates are never remembered by object (a change in
    place could not be told), so the same coordinates made again name the same plans."""
    import flexplan.nn.spconv as spconv
    from flexplan.coords_hash import known_identity
    from flexplan.workloads import random_coords

    gen = torch.Generator().manual_seed(11)
    coords = random_coords(80, (6, 5, 4), 2, generator=gen).to(device)
    feats = torch.randn(coords.shape[0], 3, generator=gen).to(device)
    pillars = random_coords(40, (6, 5, 1), 2, generator=gen)[:, :3].contiguous().to(device)
    pfeats = torch.randn(pillars.shape[0], 3, generator=gen).to(device)
    subm = spconv.SubMConv3d(3, 4, 3, indice_key="a").to(device)
    down = spconv.SparseConv3d(4, 2, 3, stride=2, padding=1).to(device)
    subm2d = spconv.SubMConv2d(3, 2, 3).to(device)
    with torch.no_grad():
        want = down(subm(spconv.SparseConvTensor(feats, coords, (6, 5, 4), 2))).features
        want2d = subm2d(spconv.SparseConvTensor(pfeats, pillars, (6, 5), 2))
    with torch.inference_mode():
        inf_coords = coords.clone()
        x = spconv.SparseConvTensor(feats.clone(), inf_coords, (6, 5, 4), 2)
        got = down(subm(x)).features
        got2d = subm2d(spconv.SparseConvTensor(pfeats.clone(), pillars.clone(), (6, 5), 2))
    assert inf_coords.is_inference() and known_identity(inf_coords) is None
    assert x.coords_identity() == spconv.SparseConvTensor(feats, coords, (6, 5, 4),
                                                          2).coords_identity()
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got2d.features, want2d.features)


def test_passed_check_remembered_until_changed(device, monkeypatch):
    """An unmodified coordinate tensor that passed the check on a grid is not checked again on
    that grid (no device work); a change in place, another grid or batch size, or an inference
    tensor is checked again, and the errors still come."""
    from flexplan import coords_check

    checks = []
    real = coords_check._check_coords
    monkeypatch.setattr(coords_check, "_check_coords",
                        lambda *args: checks.append(args[1:]) or real(*args))
    coords = _coords(device)
    SparseTensor(_feats(device=device), coords, SHAPE)
    SparseTensor(_feats(device=device), coords, SHAPE, batch_size=2)
    check_coords(coords, SHAPE, 2)
    assert len(checks) == 1
    with pytest.raises(SparseTensorError,
                       match="outside batch_size=2, spatial_shape=\\(5, 6, 6\\)"):
        check_coords(coords, (5, 6, 6), 2)  # a smaller grid: checked, and row 1 is outside it
    with pytest.raises(SparseTensorError, match="outside batch_size=1"):
        check_coords(coords, SHAPE, 1)
    check_coords(coords, SHAPE, 2, check_duplicates=False)  # (a partial check: not remembered)
    assert len(checks) == 4
    check_coords(coords, SHAPE, 2)
    assert len(checks) == 4
    coords[3] = coords[2]  # a duplicate made in place: the version moves, checked again
    with pytest.raises(SparseTensorError, match="duplicate coordinate"):
        SparseTensor(_feats(device=device), coords, SHAPE)
    coords[3, 3] = 5
    check_coords(coords, SHAPE, 2)
    coords.add_(0)  # an in-place op that leaves the values: still a new version
    check_coords(coords, SHAPE, 2)
    assert len(checks) == 7
    with torch.inference_mode():
        frozen = _coords(device)
        check_coords(frozen, SHAPE, 2)
        check_coords(frozen, SHAPE, 2)
    assert len(checks) == 9


def test_2d_indices_wrapped_again_share_coords(device):
    """The same unmodified 2D indices wrapped again give the same 3D coords object (so its
    identity and passed check are reused); after a change in place they are made (and
    checked) again."""
    import flexplan.nn.spconv as spconv

    pillars = torch.tensor([[0, 1, 2], [0, 3, 4], [1, 1, 2]], dtype=torch.int32, device=device)
    feats = _feats(3, device=device)
    a = spconv.SparseConvTensor(feats, pillars, (5, 6), 2)
    b = spconv.SparseConvTensor(feats, pillars, (5, 6), 2)
    assert a.coords is b.coords and torch.equal(b.indices, pillars)
    pillars[2, 0] = 0  # now equal to row 0: a duplicate
    with pytest.raises(SparseTensorError, match="duplicate coordinate"):
        spconv.SparseConvTensor(feats, pillars, (5, 6), 2)
    pillars[2, 1] = 4
    c = spconv.SparseConvTensor(feats, pillars, (5, 6), 2)
    assert c.coords is not a.coords and torch.equal(c.indices, pillars)
    c.coords[0, 1] = 9  # the coords changed behind the memo: not handed out again
    d = spconv.SparseConvTensor(feats, pillars, (5, 6), 2)
    assert d.coords is not c.coords and torch.equal(d.indices, pillars)


def test_memo_off_checks_every_time_and_captures_are_not_kept(device, monkeypatch):
    """FLEXPLAN_TENSOR_MEMO=0 (tensor_memo.ENABLED False) remembers nothing: every wrap checks
    again; 2D coords padded during a CUDA graph capture are not handed to later wraps."""
    import flexplan.nn.spconv as spconv
    from flexplan import coords_check, tensor_memo
    from flexplan.nn import sparse_conv_tensor

    checks = []
    real = coords_check._check_coords
    monkeypatch.setattr(coords_check, "_check_coords",
                        lambda *args: checks.append(1) or real(*args))
    monkeypatch.setattr(tensor_memo, "ENABLED", False)
    coords = _coords(device)
    SparseTensor(_feats(device=device), coords, SHAPE)
    SparseTensor(_feats(device=device), coords, SHAPE)
    assert len(checks) == 2
    monkeypatch.setattr(tensor_memo, "ENABLED", True)
    monkeypatch.setattr(sparse_conv_tensor, "capturing", lambda device: True)
    pillars = torch.tensor([[0, 1, 2], [1, 1, 2]], dtype=torch.int32, device=device)
    a = spconv.SparseConvTensor(_feats(2, device=device), pillars, (5, 6), 2)
    b = spconv.SparseConvTensor(_feats(2, device=device), pillars, (5, 6), 2)
    assert a.coords is not b.coords


def test_tensor_memo_bounded_keeps_the_latest():
    """A bounded memo keeps its latest entries (a re-put counts as new) and forgets a freed
    tensor's entry."""
    import gc

    from flexplan.tensor_memo import TensorMemo

    memo = TensorMemo(max_entries=2)
    a, b, c = torch.zeros(1), torch.zeros(2), torch.zeros(3)
    memo.put(a, "a")
    memo.put(b, "b")
    memo.put(a, "a2")  # a is now the newest
    memo.put(c, "c")  # b, the oldest, goes
    assert (memo.get(a), memo.get(b), memo.get(c)) == ("a2", None, "c") and len(memo) == 2
    del c
    gc.collect()
    assert len(memo) == 1 and memo.get(a) == "a2"
    a.add_(1)
    assert memo.get(a) is None


def test_bounded_memo_keeps_what_is_looked_up():
    """A hit makes an entry the newest in a bounded memo: a tensor used every step stays while
    others come and go; with the memo switched off nothing is answered."""
    from flexplan import tensor_memo

    memo = tensor_memo.TensorMemo(max_entries=2)
    kept = torch.zeros(1)
    memo.put(kept, "kept")
    others = [torch.zeros(2) for _ in range(5)]
    for other in others:
        memo.put(other, "other")
        assert memo.get(kept) == "kept"
    tensor_memo.ENABLED = False
    try:
        assert memo.get(kept) is None
    finally:
        tensor_memo.ENABLED = True
