"""The AOT variant set is what dispatch can return (issue #23): the conv variants of the registry
equal the launches the ops would make over a dense grid of shapes (the real resolve_algo,
select_config and constexpr functions, with and without a tuned table), the e2e networks' layers
are covered, the set does not depend on the SM count, and `python -m aot` picks its targets and
reports its build. CPU only; each test a few seconds."""
from __future__ import annotations

import importlib
import itertools
import json
import sys
from pathlib import Path

import pytest

from flexplan import paths
import torch

from flexplan.aot.variants import enumerate_variants
from flexplan.kernel_configs import (GATHER_GEMM, PARTS, PLAN_BLOCK_SIZES, WGRAD, KernelConfig,
                                     Problem, config_dtype, precision_config)
from flexplan.tuning import aot as coverage
from flexplan.tuning import dispatch, table
from flexplan.tuning.buckets import Bucket
from flexplan.tuning.device import DeviceKey, triton_version
from flexplan.tuning.table import Entry, TuningTable

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # the build package aot/ lives at the repository's root
    sys.path.insert(0, str(REPO))
WIDTHS = (4, 32, 48, 256)  # other than multiples of 16, a power of two, another multiple, wide


def _int_class(value: int) -> int:
    """Triton's class of a specialized int: 1, divisible by 16, other."""
    return 1 if value == 1 else 16 if value % 16 == 0 else 17


def _dense_rows(part: str, v: int) -> list[int]:
    """Every power of two, its successor and the midpoint of the bucket it ends (three
    quarters of it) over the covered rows (grad-weight: pairs, from the rows up to rows x
    volume): denser than tuning/aot.rows_to_cover's ends of buckets, so a config reached only
    inside a bucket (a heuristic split count) would show."""
    high = coverage.AOT_MAX_ROWS * (v if part == "wgrad" else 1)
    rows = {r for k in range(31) for r in (1 << k, (1 << k) + 1, 3 << k >> 2)}
    return sorted(r for r in rows if coverage.AOT_MIN_ROWS <= r <= high)


def _dispatched(widths) -> set:
    """What the ops launch for every covered dtype, part, width pair, volume and dense row count,
    through their own functions (select_config reads the tables of the device faked or not)."""
    from flexplan.ops.conv import (gather_gemm_constexprs, reads_weight_kvn, resolve_algo,
                                   wgrad_constexprs)

    out = set()
    for dtype, part, (ci, co), v in itertools.product(coverage.AOT_DTYPES, PARTS,
                                                      itertools.product(widths, repeat=2),
                                                      coverage.AOT_VOLUMES):
        for n in _dense_rows(part, v):
            algo = resolve_algo("auto", part, n, ci, co, v, dtype)
            if algo == "explicit":
                continue
            problem = Problem(n, ci, co, v, config_dtype(dtype, False), algo, part)
            cfg = dispatch.select_config(problem.family, problem)
            if part == "wgrad":
                cfg = precision_config(cfg, WGRAD, dtype, False)
                out.add((WGRAD, dtype, _int_class(co), _int_class(ci), _int_class(v),
                         tuple(sorted(wgrad_constexprs(cfg, dtype, False).items()))))
                continue
            m, k, nn = problem.gemm_mkn
            masked = algo.startswith("masked")
            assert not masked or cfg.block_m in PLAN_BLOCK_SIZES  # (heuristic, these tables)
            reverses = ((True,) * (v in coverage.SUBMANIFOLD_VOLUMES)
                        + (False,) * (v in coverage.STRIDED_VOLUMES)) if part == "dgrad" else (False,)
            # (the epilogue, none, bias or BatchNormReLU, is a run-time argument: no constexpr)
            for reverse in reverses:
                constexprs = gather_gemm_constexprs(cfg, masked, reverse, dtype, False,
                                                    reads_weight_kvn(part, dtype))
                out.add((GATHER_GEMM, dtype, _int_class(k), _int_class(nn), _int_class(v),
                         tuple(sorted(constexprs.items()))))
    return out


def _registry(widths) -> set:
    """The same description of the registry's conv variants for sm_90 (this machine's shared
    memory is the H100's: kernel_configs.shared_memory_bytes)."""
    out = set()
    for variant in enumerate_variants("conv", widths, ["sm_90"]):
        fn = getattr(importlib.import_module(variant.module), variant.attr)
        constexprs = dict(variant.constexprs)
        names = [n for n in fn.arg_names if n not in constexprs]
        args = dict(zip(names, variant.args))
        ints = ("CO", "CI", "V") if variant.kernel == WGRAD else ("K", "N", "V")
        feature = args["src_ptr"][1]
        dtype = ("tf32" if constexprs["PRECISION"] == "tf32" else feature)
        out.add((variant.kernel, dtype, *(args[i][1] for i in ints),
                 tuple(sorted(constexprs.items()))))
    return out


@pytest.fixture
def sm90_host(monkeypatch, tmp_path):
    """This process as an sm_90 build host without a GPU, whatever machine runs it: no current
    device (dispatch reads no table), no shipped table, an H100's shared memory and SMs."""
    import flexplan.kernel_configs as kc
    from flexplan.aot.keys import TARGET_SHARED_MEMORY

    shipped = tmp_path / "shipped"
    shipped.mkdir()
    monkeypatch.setattr(paths, "shipped_tables_dir", lambda: shipped)
    monkeypatch.setenv("FLEXPLAN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(dispatch.TUNE_ENV, raising=False)
    monkeypatch.setattr(dispatch, "current_device_index", lambda: None)
    monkeypatch.setattr(kc, "shared_memory_bytes", lambda: TARGET_SHARED_MEMORY["sm_90"])
    monkeypatch.setattr(kc, "num_sms", lambda: 132)
    _forget_configs()
    yield shipped
    _forget_configs()


def _forget_configs():
    import flexplan.kernel_configs as kc

    kc.heuristic_config.cache_clear()
    kc.choose_algo.cache_clear()
    coverage._conv_launches.cache_clear()
    dispatch.reset()


def test_conv_variants_are_what_dispatch_returns_over_a_dense_grid(sm90_host):
    """No variant dispatch cannot pick, none it can pick missing: the registry's few row counts
    per shape (tuning/aot.rows_to_cover) reach what every power of two and its successor do."""
    assert _registry(WIDTHS) == _dispatched(WIDTHS)


def test_a_usable_tuned_table_adds_exactly_its_reachable_configs(sm90_host, monkeypatch):
    """A table for sm_90 under this Triton, on a faked current GPU: its configs where "auto"
    asks for them (a masked forward of many rows, a split grad-weight) are built, the one of an
    algorithm "auto" never picks is not."""
    fwd = Bucket("fwd", "masked", "float16", 27, 64, 64, 1 << 20)
    wgrad = Bucket("wgrad", "masked_splitk", "tf32", 27, 64, 64, 1 << 20)
    never = Bucket("fwd", "implicit", "float16", 27, 64, 64, 1 << 20)
    configs = {fwd: KernelConfig(64, 64, 32, 1, 8, 3), wgrad: KernelConfig(32, 64, 64, 4, 8, 4),
               never: KernelConfig(16, 16, 16, 1, 4, 2)}
    gpu = DeviceKey("Some sm_90 GPU", "sm_90", 132, triton_version())
    table.write_table(TuningTable(gpu, {b: Entry(c, 1.0, 2.0, 3) for b, c in configs.items()}),
                      sm90_host / "gpu.json")
    monkeypatch.setattr(dispatch, "current_device_index", lambda: 0)
    monkeypatch.setattr(dispatch, "device_key", lambda index: gpu)
    widths = (16, 64)
    registry = _registry(widths)
    assert registry == _dispatched(widths)
    picked = {(kernel, dtype, tuple(dict(c)[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K",
                                                          "num_warps", "num_stages")))
              for kernel, dtype, *_, c in registry}
    assert (GATHER_GEMM, "float16", (64, 64, 32, 8, 3)) in picked
    assert (WGRAD, "tf32", (32, 64, 64, 8, 4)) in picked
    assert (WGRAD, "float32", (32, 64, 64, 8, 2)) in picked  # 3xTF32's shallower pipeline
    assert all(dict(c)["MASKED"] for kernel, *_, c in registry if kernel == GATHER_GEMM)


def test_tuned_buckets_near_the_ends_keep_the_heuristic_configs_built(sm90_host, monkeypatch):
    """A tuned bucket lends its config to the other buckets of its shape (dispatch.
    neighbour_config): built for them; where its split-K workspace would not fit (16 splits of
    256 x 256 channels from 2^14 rows on) the heuristic runs there alone (the masked buckets of
    that width borrow a tuned config at every row count) and is built too: the cover reaches
    inside the range, not only its ends (buckets near the low end, the high end and between)."""
    high = coverage.AOT_MAX_ROWS
    configs = {Bucket("fwd", "masked", "float16", 27, 32, 32, high >> 2):
               KernelConfig(64, 32, 32, 1, 4, 3),
               Bucket("fwd", "masked_splitk", "float16", 27, 32, 32, 256):
               KernelConfig(32, 32, 32, 2, 4, 2),
               Bucket("dgrad", "masked", "float16", 27, 32, 32, 1 << 14):
               KernelConfig(128, 32, 32, 1, 4, 4),
               # (every volume: the variants of two volumes of one size class are one)
               **{Bucket("fwd", "masked_splitk", "float16", v, 256, 256, 256):
                  KernelConfig(64, 64, 32, 16, 4, 2) for v in coverage.AOT_VOLUMES},
               **{Bucket("fwd", "masked", "float16", v, 256, 256, 1 << 20):
                  KernelConfig(64, 128, 32, 1, 8, 3) for v in coverage.AOT_VOLUMES}}
    gpu = DeviceKey("Some sm_90 GPU", "sm_90", 132, triton_version())
    table.write_table(TuningTable(gpu, {b: Entry(c, 1.0, 2.0, 3) for b, c in configs.items()}),
                      sm90_host / "gpu.json")
    monkeypatch.setattr(dispatch, "current_device_index", lambda: 0)
    monkeypatch.setattr(dispatch, "device_key", lambda index: gpu)
    assert _registry((32,)) == _dispatched((32,))
    assert _registry((256,)) == _dispatched((256,))


def test_tables_of_another_triton_or_gpu_are_not_built(monkeypatch, tmp_path):
    """Dispatch ignores a table tuned under another Triton (or for another arch): so does the
    build (the shipped H100 table is Triton 3.6's; this is 3.9)."""
    gpu = DeviceKey("Some sm_90 GPU", "sm_90", 132, "0.0.1")
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    bucket = Bucket("fwd", "masked", "float16", 27, 64, 64, 1 << 20)
    table.write_table(TuningTable(gpu, {bucket: Entry(KernelConfig(64, 64, 32, 1, 8, 3), 1, 2, 3)}),
                      shipped / "gpu.json")
    monkeypatch.setattr(paths, "shipped_tables_dir", lambda: shipped)
    assert coverage.target_tables("sm_90") == {}
    assert coverage.target_tables("sm_80") == {}


def test_the_set_does_not_depend_on_the_sm_count(sm90_host, monkeypatch):
    """Split-K's reach depends on the SM count only far from the row counts covered: a small
    and a large GPU of one target build the same variants."""
    import flexplan.kernel_configs as kc
    from flexplan.aot import variants

    reference = set(variants.conv_variants("sm_86", (16, 64, 256)))
    for sms in (28, 304):
        monkeypatch.setattr(kc, "num_sms", lambda sms=sms: sms)
        _forget_configs()
        assert set(variants.conv_variants("sm_86", (16, 64, 256))) == reference, sms


def test_the_e2e_networks_layers_are_covered():
    """Every conv of scripts/e2e_networks.py (real widths) has a covered width pair, volume and,
    unless inverse (it reuses its paired conv's plan), geometry."""
    import flexplan.nn.spconv as sp

    sys.path.insert(0, str(REPO / "scripts"))
    try:
        from e2e_networks import NETWORKS
    finally:
        sys.path.remove(str(REPO / "scripts"))
    pairs = set(coverage.default_channel_pairs())
    geometries = set(coverage.AOT_GEOMETRIES)
    seen = 0
    for net_cls in NETWORKS.values():
        for module in net_cls(sp).modules():
            geometry = getattr(module, "geometry", None)
            if geometry is None:
                continue
            seen += 1
            assert (module.in_channels, module.out_channels) in pairs, module
            assert geometry.volume in coverage.AOT_VOLUMES, module
            assert getattr(module, "inverse", False) or geometry in geometries, module
    assert seen > 20


def test_lean_set_sizes():
    """The conv variants are the distinct (config, specialization) pairs: a few hundred per target,
    not thousands (measured: 690 conv + 178 other kernels' for sm_90 with Triton 3.9; split-K
    configs sum their partials in the conv kernels, so those come with and without bias, the
    forwards also with the BatchNormReLU epilogue (16-bit features: its norms in their dtype
    and in float32), and grad-weight's also with a float32 output for autocast's master
    weights)."""
    variants = enumerate_variants(targets=["sm_90"])
    assert len(variants) == len(set(variants)) < 900
    assert sum(v.kernel.startswith("conv_") for v in variants) < 720


# ---------------------------------------------------------------- python -m aot: targets, report

def test_targets_default_to_this_machines_gpus(monkeypatch):
    from aot import targets
    from flexplan.tuning import device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert targets.default_targets() == (list(targets.DEFAULT_TARGETS), "no GPU here: the default list")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    archs = {0: "sm_90", 1: "sm_80", 2: "sm_90"}
    monkeypatch.setattr(device, "device_key", lambda i: DeviceKey("GPU", archs[i], 100, "3.9.0"))
    assert targets.default_targets() == (["sm_90", "sm_80"], "this machine's GPUs")
    archs[1] = "sm_120"
    with pytest.raises(SystemExit, match="sm_120 is not one flexplan builds for"):
        targets.default_targets()


def test_rocm_gpus_are_named_by_their_gfx_arch(monkeypatch):
    """ROCm reports "gfx942:sramecc+:xnack-": the target is gfx942 (tuning.device names archs
    for tables and the AOT build alike)."""
    from types import SimpleNamespace

    from flexplan.tuning import device

    props = SimpleNamespace(gcnArchName="gfx942:sramecc+:xnack-", name="AMD Instinct MI300X",
                            multi_processor_count=304, major=9, minor=4)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)
    monkeypatch.setattr(torch.version, "hip", "6.2")
    device.device_key.cache_clear()
    try:
        assert device.device_key(0).arch == "gfx942"
    finally:
        device.device_key.cache_clear()


def test_build_summary_counts_binaries_megabytes_and_time(tmp_path):
    from aot.report import failure_lines, manifest_of, summary_line

    entries = []
    for target, ext, size in (("sm_90", "cubin", 300_000), ("sm_90", "cubin", 200_000),
                              ("gfx942", "hsaco", 500_000)):
        stem = f"{target}/k/{len(entries)}"
        (tmp_path / target / "k").mkdir(parents=True, exist_ok=True)
        (tmp_path / f"{stem}.{ext}").write_bytes(b"\0" * size)
        (tmp_path / f"{stem}.json").write_bytes(b"{}")
        entries.append({"target": target, "file": f"{stem}.{ext}", "metadata": f"{stem}.json"})
    failed = [{"target": "sm_90", "kernel": "k", "key": "x", "error": "OutOfResources: shared"}]
    (tmp_path / "manifest.json").write_text(json.dumps(
        {"triton_version": "3.9.0", "entries": entries, "failed": failed}))
    line = summary_line(tmp_path, 61.4)
    assert line.startswith("aot: 3 binaries (gfx942 1, sm_90 2), 1.0 MB, 61 s; Triton 3.9.0"), line
    lines = failure_lines(manifest_of(tmp_path))
    assert "does not compile: OutOfResources" in lines[0] and lines[-1].startswith("aot: 1 variants")


def test_tf32_only_where_the_gpu_has_it(monkeypatch):
    """gfx90a and RDNA have no TF32 dot (Triton refuses input_precision="tf32" there): the AOT
    set builds no tf32 variant for them, and a float32 call with TF32 allowed runs exact on
    them, as dispatch would pick it."""
    import torch

    from flexplan import kernel_configs
    from flexplan.ops import conv as conv_ops
    from flexplan.tuning.aot import conv_launches

    assert kernel_configs.has_tf32(False, "sm_80") and kernel_configs.has_tf32(True, "gfx942")
    assert not kernel_configs.has_tf32(True, "gfx90a:sramecc+:xnack-")
    assert not kernel_configs.has_tf32(True, "gfx1100") and not kernel_configs.has_tf32(True, None)
    pairs = [(16, 16)]
    for target, has in (("gfx942", True), ("gfx90a", False), ("gfx1100", False)):
        dtypes = {launch.dtype for launch in conv_launches(target, True, 65536, pairs)}
        assert ("tf32" in dtypes) == has, target
        assert "float32" in dtypes
    assert "tf32" in {launch.dtype for launch in conv_launches("sm_90", False, 232448, pairs)}
    # the runtime's choice on a GPU of each kind (the device index's arch, faked)
    cuda0 = torch.device("cuda", 0)
    for hip, arch, want in ((True, "gfx90a:sramecc+", "float32"), (True, "gfx942", "tf32"),
                            (False, None, "tf32")):
        monkeypatch.setattr(conv_ops, "runtime_has_tf32", lambda index: has_tf32_of(hip, arch))
        assert conv_ops._dtype_name(torch.float32, True, cuda0) == want
        assert conv_ops._dtype_name(torch.float32, False, cuda0) == "float32"
        assert conv_ops._dtype_name(torch.float16, True, cuda0) == "float16"


def has_tf32_of(hip, arch):
    from flexplan.kernel_configs import has_tf32

    return has_tf32(hip, arch)


def test_two_gpus_of_one_arch_get_both_their_configs_built(monkeypatch, tmp_path):
    """Two shipped tables of one arch and Triton (an H100's, an H200's) may pick two configs for
    one bucket: the arch's build holds the launches of both, as either GPU dispatches them."""
    from flexplan.tuning.device import triton_version

    shipped = tmp_path / "shipped"
    shipped.mkdir()
    bucket = Bucket("fwd", "masked", "float16", 27, 64, 64, 1 << 14)
    picks = (KernelConfig(64, 64, 32, 1, 4, 3), KernelConfig(128, 64, 64, 1, 8, 4))
    for name, config in zip(("a", "b"), picks):
        gpu = DeviceKey(f"GPU {name}", "sm_90", 132, triton_version())
        table.write_table(TuningTable(gpu, {bucket: Entry(config, 1, 2, 3)}),
                          shipped / f"{name}.json")
    monkeypatch.setattr(paths, "shipped_tables_dir", lambda: shipped)
    assert len(coverage.target_table_list("sm_90")) == 2
    launched = {launch.config for launch in coverage.conv_launches(
        "sm_90", False, 228 * 1024, ((64, 64),), ("float16",), (27,), (1 << 14, 1 << 14),
        algos=("masked",)) if launch.problem.part == "fwd"}
    assert set(picks) <= launched
