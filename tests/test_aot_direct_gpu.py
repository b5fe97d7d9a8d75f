"""Direct launch on a CUDA GPU (flexplan.aot.direct): bundle binaries launched through the driver
API give bitwise the results of Triton's JIT and of Triton's own launcher on the same binaries.

Builds a small bundle for this GPU (the conv kernels at 16 channels; the planner kernels stay
JIT), then runs SubMConv3d forward + backward per dtype in four fresh processes:
  jit     FLEXPLAN_AOT=0
  triton  the bundle, launched through Triton's launcher (FLEXPLAN_AOT_LAUNCH=triton)
  direct  the bundle, launched directly (launcher.NATIVE_BUNDLE_LAUNCHES off)
  native  the bundle, repeated launches through flexplan/launch_native.py (the default)
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.gpu

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DTYPES = ("float16", "bfloat16", "float32")

_CHILD = r'''
import sys, torch
from flexplan import SparseTensor
from flexplan.aot import runtime
from flexplan.nn.submconv import SubMConv3d
from flexplan.workloads import sphere_shell

import os
from flexplan import launch_native, launcher

if os.environ.get("NATIVE_BUNDLE_LAUNCHES") == "0":  # (the default: bundle binaries native)
    launcher.NATIVE_BUNDLE_LAUNCHES = False
res, channels, save = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
coords = sphere_shell(res, device="cuda")
results = {}
for name in sys.argv[4:]:
    dtype = getattr(torch, name)
    for _ in range(2):  # the second call repeats every launch (the memo, native records)
        gen = torch.Generator().manual_seed(1)
        feats = torch.randn(len(coords), channels, generator=gen).to("cuda", dtype).requires_grad_()
        torch.manual_seed(2)
        conv = SubMConv3d(channels, channels, device="cuda", dtype=dtype)
        out = conv(SparseTensor(feats, coords, (res, res, res), 1)).feats
        out.backward(torch.randn(out.shape, generator=gen).to("cuda", dtype))
        results[name] = [t.detach().cpu() for t in (out, feats.grad, conv.weight.grad, conv.bias.grad)]
native = [launcher._native_kernels[key[0]][0].fn.__name__ for key in launcher._native_calls]
loaded = launch_native.module(build=False)  # (built by the test before: loaded, not compiled)
stats = dict(runtime.stats, native_conv_records=sum(n.startswith("conv_") for n in native),
             native_launches=loaded.launched() if loaded is not None else 0)
torch.save({"results": results, "stats": stats}, save)
'''


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from flexplan.aot import direct
    from flexplan.aot.keys import TARGETS

    if direct.unavailable() is not None:
        pytest.skip(f"direct launch is off here: {direct.unavailable()}")
    major, minor = torch.cuda.get_device_capability()
    target = f"sm_{major}{minor}"
    if target not in TARGETS:
        pytest.skip(f"no AOT target for {target}")
    work = tmp_path_factory.mktemp("aot-direct")
    bundle = work / "bundle"
    build = subprocess.run([sys.executable, "-m", "aot", "--targets", target, "--kernels", "conv", "--channels", "16",
                            "--out", str(bundle), "-j", str(os.cpu_count() or 1)],
                           cwd=REPO, capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    base = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "FLEXPLAN_AOT_PATH")}
    base.update(PYTHONPATH=REPO, FLEXPLAN_CACHE_DIR=str(work / "cache"))
    modes = {"jit": {"FLEXPLAN_AOT": "0"},
             "triton": {"FLEXPLAN_AOT_PATH": str(bundle), "FLEXPLAN_AOT_LAUNCH": "triton"},
             "direct": {"FLEXPLAN_AOT_PATH": str(bundle), "NATIVE_BUNDLE_LAUNCHES": "0"},
             "native": {"FLEXPLAN_AOT_PATH": str(bundle)}}
    # The native launcher's library, built once into the shared cache (as `python -m aot
    # --install` does): the bundle-served processes load it without compiling.
    prebuild = subprocess.run([sys.executable, "-c", "from flexplan import launch_native; "
                               "print(launch_native.build())"], cwd=REPO, env=base,
                              capture_output=True, text=True, timeout=600)
    assert prebuild.returncode == 0, prebuild.stdout[-3000:] + prebuild.stderr[-3000:]
    out = {}
    for mode, env in modes.items():
        save = work / f"{mode}.pt"
        proc = subprocess.run([sys.executable, "-c", _CHILD, "32", "16", str(save), *DTYPES], cwd=REPO,
                              env=dict(base, TRITON_CACHE_DIR=str(work / f"tc-{mode}"), **env),
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, f"{mode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        out[mode] = torch.load(save)
    return out


def _assert_bitwise_equal(a: dict, b: dict) -> None:
    bits = lambda t: t.contiguous().view(torch.uint8)  # noqa: E731
    for dtype in DTYPES:
        for name, x, y in zip(("output", "grad-input", "grad-weight", "grad-bias"), a[dtype], b[dtype]):
            assert x.shape == y.shape and torch.equal(bits(x), bits(y)), f"{dtype} {name}"


def test_bundle_binaries_launch_directly(runs):
    direct, triton_launcher = runs["direct"]["stats"], runs["triton"]["stats"]
    assert direct.get("direct", 0) > 0 and direct["direct"] == direct["aot"], direct
    assert triton_launcher.get("aot", 0) > 0 and triton_launcher.get("direct", 0) == 0, triton_launcher


def test_direct_launch_is_bitwise_equal_to_jit(runs):
    _assert_bitwise_equal(runs["direct"]["results"], runs["jit"]["results"])


def test_direct_launch_is_bitwise_equal_to_tritons_launcher(runs):
    _assert_bitwise_equal(runs["direct"]["results"], runs["triton"]["results"])


def test_native_bundle_launches_are_bitwise_equal_to_direct_ones(runs):
    native, direct = runs["native"]["stats"], runs["direct"]["stats"]
    assert native["native_conv_records"] > 0, native
    assert direct["native_conv_records"] == 0, direct
    # The same workload: the planner's JIT kernels launch natively in both; the bundle's conv
    # binaries only here (their repeated launches went through the C path, not declined).
    assert native["native_launches"] > direct["native_launches"], (native, direct)
    _assert_bitwise_equal(runs["native"]["results"], runs["direct"]["results"])
