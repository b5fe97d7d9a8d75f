"""Ahead-of-time kernels on the CPU: a small real build (sm_90 + gfx942), ninja incrementality,
bundle validation, and the runtime's dispatch decisions driven through Triton's own JIT path.

The build and runtime checks run in subprocesses without TRITON_INTERPRET (this suite runs under
the interpreter, where kernels are not compiled at all)."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
EM_CUDA, EM_AMDGPU = 190, 224  # ELF e_machine of a cubin / an hsaco


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(REPO)
    env.update(extra)
    return env


def _build(out: Path) -> str:
    cmd = [sys.executable, "-m", "aot", "--targets", "sm_90,gfx942", "--sample", "1", "--out", str(out), "-j", "2"]
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    out = tmp_path_factory.mktemp("aot") / "bundle"
    first = _build(out)
    return out, first


def _manifest(out: Path) -> dict:
    return json.loads((out / "manifest.json").read_text())


def test_build_writes_valid_binaries_and_manifest(bundle):
    out, log = bundle
    manifest = _manifest(out)
    import triton

    assert manifest["triton_version"] == triton.__version__
    entries = manifest["entries"]
    kinds = {(e["target"], e["kernel"].rsplit(".", 1)[-1]) for e in entries}
    assert {t for t, _ in kinds} == {"sm_90", "gfx942"}
    assert {k for _, k in kinds} >= {"conv_gather_gemm_kernel", "conv_wgrad_kernel"}
    for e in entries:
        assert {"kernel", "signature", "constants", "target", "triton_version", "source_hash",
                "file", "sha256"} <= set(e)
        blob = (out / e["file"]).read_bytes()
        assert blob[:4] == b"\x7fELF", e["file"]
        machine = int.from_bytes(blob[18:20], "little")
        assert machine == (EM_CUDA if e["target"] == "sm_90" else EM_AMDGPU), (e["file"], machine)
        assert e["file"].endswith(".cubin" if e["target"] == "sm_90" else ".hsaco")
        assert hashlib.sha256(blob).hexdigest() == e["sha256"]
        meta = json.loads((out / e["metadata"]).read_text())
        assert meta["name"] == e["kernel"].rsplit(".", 1)[-1]
    assert f"[{len(entries) + 1}/{len(entries) + 1}]" in log  # ninja's progress line


def test_second_build_is_noop(bundle):
    out, _ = bundle
    before = (out / "manifest.json").stat().st_mtime_ns
    assert "ninja: no work to do." in _build(out)
    assert (out / "manifest.json").stat().st_mtime_ns == before


def test_touching_one_kernel_source_rebuilds_only_its_binaries(bundle):
    out, _ = bundle
    source = REPO / "kernels_src" / "conv_wgrad.py"
    stamp = time.time() + 5  # newer than every artifact; the content is untouched
    os.utime(source, (stamp, stamp))
    log = _build(out)
    rebuilt = [line.split()[3] for line in log.splitlines() if " AOT sm_90 " in line or " AOT gfx942 " in line]
    assert sorted(rebuilt) == ["conv_wgrad", "conv_wgrad"], log
    assert "AOT manifest" in log


# ---------------------------------------------------------------- runtime (Triton's JIT path)

_PROBE = r'''
import json, logging, os, sys
import triton
from triton.compiler.compiler import make_backend
from triton.runtime.jit import create_function_from_signature
from flexplan.aot import runtime
from flexplan.aot.keys import gpu_target
from flexplan.aot.specialize import _example
from flexplan.aot.variants import enumerate_variants
import importlib

records = []
logging.basicConfig(level=logging.WARNING, format="LOG %(message)s", stream=sys.stdout)

def request(kernel, change=None):
    """Drive Triton's own JIT compile path (_do_compile) for the first registry variant of
    kernel on a fake sm_90 device; returns "aot" if the hook served it, "jit" if Triton compiled."""
    variant = next(v for v in enumerate_variants() if v.kernel == kernel)
    fn = getattr(importlib.import_module(variant.module), variant.attr)
    target = gpu_target("sm_90")
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    fn.device_caches["probe"] = ({}, {}, target, backend, binder)
    fn.ASTSource, fn.CompiledKernel = triton.compiler.ASTSource, triton.compiler.CompiledKernel
    fn.compile = lambda *a, **k: "JIT-COMPILED"
    kwargs = dict(variant.constexprs)
    kwargs.update(change or {})
    bound, spec, opts = binder(*map(_example, variant.args), **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, dict(kwargs), bound, spec, opts)
    got = fn._do_compile("probe-key", signature, "probe", constexprs, options, attrs, False)
    cached = fn.device_caches["probe"][0].get("probe-key")
    if got is None and cached is not None and cached != "JIT-COMPILED":
        return {"served": "aot", "binary_bytes": len(cached.kernel), "name": cached.name}
    return {"served": "jit" if got == "JIT-COMPILED" else repr(got)}

runtime.install()
out = {}
for scenario in sys.argv[1:]:
    name, path = scenario.split("=")
    os.environ["FLEXPLAN_AOT_PATH"] = path
    runtime.reset()
    out[name] = {"wgrad": request("conv_wgrad"), "gemm": request("conv_gather_gemm"),
                 "other_warps": request("conv_wgrad", {"num_warps": 2}),
                 "refused": runtime.refused_bundles(), "stats": dict(runtime.stats)}
print("RESULT " + json.dumps(out))
'''


@pytest.fixture(scope="module")
def probe(bundle, tmp_path_factory):
    out, _ = bundle
    work = tmp_path_factory.mktemp("aot-variants")
    damaged = work / "damaged"
    shutil.copytree(out, damaged, ignore=shutil.ignore_patterns("specs", ".triton-cache"))
    manifest = _manifest(damaged)
    wgrad = next(e for e in manifest["entries"]
                 if e["target"] == "sm_90" and e["kernel"].endswith("conv_wgrad_kernel"))
    blob = bytearray((damaged / wgrad["file"]).read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    (damaged / wgrad["file"]).write_bytes(bytes(blob))
    other = work / "other"
    shutil.copytree(out, other, ignore=shutil.ignore_patterns("specs", ".triton-cache"))
    manifest["triton_version"] = "0.0.1"
    (other / "manifest.json").write_text(json.dumps(manifest))
    scenarios = [f"good={out}", f"damaged={damaged}", f"other={other}", f"none={work / 'missing'}"]
    proc = subprocess.run([sys.executable, "-c", _PROBE, *scenarios], cwd=REPO, capture_output=True,
                          text=True, timeout=300, env=_env(FLEXPLAN_CACHE_DIR=str(work / "cache")))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))
    logs = [line for line in proc.stdout.splitlines() if line.startswith("LOG ")]
    return json.loads(result[len("RESULT "):]), logs


def test_runtime_serves_the_prebuilt_binary_without_compiling(probe):
    result, _ = probe
    good = result["good"]
    assert good["wgrad"]["served"] == "aot" and good["wgrad"]["name"] == "conv_wgrad_kernel"
    assert good["gemm"]["served"] == "aot" and good["gemm"]["binary_bytes"] > 0
    assert good["refused"] == []


def test_runtime_falls_back_to_jit_with_one_log_line(probe):
    result, logs = probe
    assert result["good"]["other_warps"]["served"] == "jit"  # variant not built
    assert result["none"]["wgrad"]["served"] == "jit"  # no bundle at all
    jit_lines = [line for line in logs if "conv_wgrad_kernel: " in line and "JIT" in line]
    # once per kernel per scenario (the probe resets between scenarios): good, damaged, other, none
    assert len(jit_lines) == 4, logs


def test_damaged_binary_is_skipped(probe):
    result, logs = probe
    assert result["damaged"]["wgrad"]["served"] == "jit"
    assert result["damaged"]["gemm"]["served"] == "aot"  # the rest of the bundle still serves
    assert any("damaged (sha256 mismatch)" in line for line in logs), logs


def test_manifest_of_another_triton_is_refused(probe):
    import triton

    result, logs = probe
    other = result["other"]
    assert other["wgrad"]["served"] == "jit" and other["gemm"]["served"] == "jit"
    (message,) = other["refused"]
    assert "built with Triton 0.0.1" in message and f"this is Triton {triton.__version__}" in message
    assert any("built with Triton 0.0.1" in line for line in logs)


# ---------------------------------------------------------------- registry vs the real ops

def test_registry_reproduces_the_ops_launches(monkeypatch):
    """Record every launch of plan builds (submanifold, strided, the coordinate hash), of the
    plan-file load check, of a small SubMConv3d forward + backward, of pooling and of
    SyncBatchNorm's statistics kernels, and check the registry lists each one's exact
    specialization (Triton's binder for sm_90 on both sides: argument types, the classes of the
    ints and pointers it specializes, constexprs, launch options). Sizes are not specialized,
    so this tiny problem's launches are the registry's."""
    import importlib

    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    from flexplan import ConvGeometry, SparseTensor, build_plan, launcher
    from flexplan.aot.specialize import _example
    from flexplan.aot.variants import KERNELS, enumerate_variants
    from flexplan.cache.format import plan_problem
    from flexplan.coords_hash import coords_digest
    from flexplan.planner.generative_triton import (transposed_map_and_t_triton,
                                                    transposed_map_triton)
    from flexplan.nn.submconv import SubMConv3d
    from flexplan.ops import BatchNormReLU
    from flexplan.ops.pool import sparse_pool
    from flexplan.workloads import random_coords

    backend, binders = make_backend(GPUTarget("cuda", 90, 32)), {}

    def specialization(kernel, args, constexprs):
        fn = launcher.jit_function(kernel)
        if fn.fn not in binders:
            binders[fn.fn] = create_function_from_signature(fn.signature, fn.params, backend)
        _, spec, options = binders[fn.fn](*args, **constexprs)
        return fn.fn.__name__, tuple(spec), tuple(sorted(options.items()))

    known = set()
    for v in enumerate_variants(targets=["sm_90"]):
        kernel = getattr(importlib.import_module(v.module), v.attr)
        known.add(specialization(kernel, [_example(a) for a in v.args], dict(v.constexprs)))
    seen = []
    real_launch = launcher.launch

    def recording_launch(kernel, grid, *args, **constexprs):
        seen.append(specialization(kernel, args, constexprs))
        return real_launch(kernel, grid, *args, **constexprs)

    for name in ("flexplan.ops.conv", "flexplan.ops.pool", "flexplan.planner.hashmap",
                 "flexplan.planner.segments_triton", "flexplan.planner.generative_triton",
                 "flexplan.coords_hash", "flexplan.nn.sync_batchnorm"):
        monkeypatch.setattr(importlib.import_module(name), "launch", recording_launch)
    monkeypatch.setattr(launcher, "launch", recording_launch)  # the plan views import it late
    monkeypatch.setattr(importlib.import_module("flexplan.plan_views"), "CHUNK_ORDER_MIN_ROWS", 0)
    gen = torch.Generator().manual_seed(0)
    coords = random_coords(40, (8, 8, 8), batch_size=1, generator=gen)
    coords_digest(coords, use_triton=True)
    for geometry in (ConvGeometry.submanifold_conv(3, 1),
                     ConvGeometry.make(2, stride=2, submanifold=False),
                     ConvGeometry.make(3, stride=2, padding=1, submanifold=False)):
        build_plan(coords, (8, 8, 8), 1, geometry, backend="triton")
    transposed_map_triton(build_plan(coords, (8, 8, 8), 1, geometry).fwd.neighbor_map,
                          len(coords))  # an inverse conv's bwd map (its inference plan's)
    for extra in range(4):  # with its layout, at row counts of every alignment of the layout
        transposed_map_and_t_triton(build_plan(coords, (8, 8, 8), 1, geometry).fwd.neighbor_map,
                                    len(coords) + extra)
    # a first sighting's submanifold inference plan (unscheduled, its layout from the hash)
    build_plan(coords, (8, 8, 8), 1, ConvGeometry.submanifold_conv(3, 1), backend="triton",
               training=False, scheduled=False)
    plan_problem(build_plan(coords, (8, 8, 8), 1, ConvGeometry.submanifold_conv(3, 1)))
    for dtype in (torch.float32, torch.float16):
        x = SparseTensor(torch.randn(len(coords), 16, generator=gen).to(dtype).requires_grad_(),
                         coords, (8, 8, 8), 1)
        for algo in ("auto", "explicit"):  # explicit: its im2col kernel
            conv = SubMConv3d(16, 16, dtype=dtype, algo=algo)
            conv(x).feats.float().square().sum().backward()
        # an eval conv -> BatchNorm -> ReLU block's epilogue, BatchNorm in the features' dtype
        # and in float32 (an fp32 model under autocast)
        conv = SubMConv3d(16, 16, dtype=dtype, bias=False)
        for bn_dtype in (dtype, torch.float32):
            bn = torch.nn.BatchNorm1d(16, dtype=bn_dtype).eval()
            with torch.no_grad():
                conv(x, bn_relu=BatchNormReLU(bn.running_mean, bn.running_var, bn.weight,
                                              bn.bias, bn.eps))
        pool_plan = build_plan(coords, (8, 8, 8), 1, ConvGeometry.make(2, stride=2,
                                                                         submanifold=False))
        for mode in ("max", "avg"):
            sparse_pool(x.feats, pool_plan, mode).float().sum().backward()
            with torch.no_grad():
                sparse_pool(x.feats, pool_plan, mode)
    # SyncBatchNorm's CUDA path (its forward's pack_sums / finalize_sums; CPU inputs take torch
    # ops, and torch.batch_norm_stats is CUDA-only, so called here as that forward calls them):
    # statistics of 16-bit / fp32 inputs (float32) and of fp64 ones, the module's running
    # statistics in each dtype a model has them; by momentum, cumulative, none tracked.
    from flexplan.nn import sync_batchnorm as sbn

    for sd, running in ((torch.float32, torch.float32), (torch.float32, torch.float16),
                        (torch.float32, torch.bfloat16), (torch.float64, torch.float64)):
        feats = torch.randn(len(coords), 16, generator=gen, dtype=sd)
        var, mean = torch.var_mean(feats, 0, correction=0)
        packed = sbn.pack_sums(mean, var.rsqrt(), len(coords))  # batch_norm_stats' (sd)
        bn = sbn.SyncBatchNorm(16, dtype=running)
        for momentum in (0.1, None):
            sbn.finalize_sums(packed, sd, bn.eps, momentum, bn.num_batches_tracked,
                              bn.running_mean, bn.running_var)
        sbn.finalize_sums(packed, sd, bn.eps, 0.1, None, None, None)  # track_running_stats=False
    kernels = {k.split(":")[1] for k in KERNELS.values()}
    assert {s[0] for s in seen} == kernels  # every kernel of the registry, nothing else
    for call in seen:
        assert call in known, call


def test_variants_follow_each_targets_shared_memory():
    """The heuristic keeps three tiles in flight only where shared memory holds them, so each
    target's build lists that target's pick (a 64 KiB LDS gets the two-tile config)."""
    from flexplan.aot.keys import TARGET_SHARED_MEMORY
    from flexplan.aot.variants import enumerate_variants
    from flexplan.kernel_configs import GATHER_GEMM, Problem, heuristic_config

    problem = Problem(1 << 14, 128, 128, 27, "float16", "masked", "fwd")
    picks = {t: heuristic_config(GATHER_GEMM, problem, TARGET_SHARED_MEMORY[t]).num_stages
             for t in ("sm_90", "gfx942")}
    assert picks == {"sm_90": 5, "gfx942": 3}

    def stages_of_128_tiles(target):
        return {dict(v.constexprs)["num_stages"] for v in enumerate_variants("gather", [128], [target])
                if v.args[0] == ("tensor", "float16")  # src
                and {k: dict(v.constexprs)[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K")}
                == {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64}}

    assert stages_of_128_tiles("sm_90") == {5}
    assert stages_of_128_tiles("gfx942") == {3}


def test_doctor_lists_the_bundle(bundle, tmp_path):
    out, _ = bundle
    env = _env(FLEXPLAN_AOT_PATH=str(out), FLEXPLAN_CACHE_DIR=str(tmp_path))
    proc = subprocess.run([sys.executable, "-m", "flexplan", "doctor", "--target", "sm_90"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"bundle:  {out}" in proc.stdout and "usable" in proc.stdout
    assert "launch:  Triton's launcher (" in proc.stdout  # this CPU machine: no libcuda / not Triton 3.6
    assert "native:  off (" in proc.stdout  # (no driver, or not Triton 3.6: says which)
    assert "precompiled for sm_90: " in proc.stdout and "conv_wgrad_kernel x1" in proc.stdout
    assert "JIT-compiled on first use here: " in proc.stdout


def test_install_copies_the_bundle_into_the_user_cache(bundle, tmp_path, monkeypatch):
    from flexplan.aot.bundle import bundle_dirs, install_bundle, read_bundle

    out, _ = bundle
    monkeypatch.setenv("FLEXPLAN_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("FLEXPLAN_AOT_PATH", raising=False)
    dest = install_bundle(out)
    assert dest.parent == tmp_path / "aot" and dest in bundle_dirs()
    installed = read_bundle(dest)
    assert installed.problem is None and installed.entries == _manifest(out)["entries"]
    assert all(installed.entry_files_ok(e) is None for e in installed.entries)
    assert not (dest / "build.ninja").exists()  # binaries and manifest only


# ---------------------------------------------------------------- direct launch (flexplan.aot.direct)

def test_bundle_records_the_kernel_parameter_sizes(bundle):
    """The build reads each cubin's parameter sizes from its PTX; the direct launcher's layout
    (Triton 3.6's launcher ABI) must produce exactly those for every kernel Triton compiled here."""
    import importlib

    from flexplan.aot.kernel_params import kernel_params, param_bytes
    from flexplan.aot.variants import KERNELS

    out, _ = bundle
    entries = _manifest(out)["entries"]
    for e in entries:
        if e["target"] != "sm_90":
            assert "param_bytes" not in e
            continue
        module, attr = e["kernel"].rsplit(".", 1)
        fn = getattr(importlib.import_module(module), attr)
        signature = {name: e["signature"][name] for name in fn.arg_names}  # the manifest sorts keys
        assert param_bytes(kernel_params(signature)) == e["param_bytes"], e["kernel"]
    assert len({e["kernel"] for e in entries if e["target"] == "sm_90"}) == len(KERNELS)


_DIRECT_PROBE = r'''
import ctypes, importlib, json, logging, os, sys
import torch, triton
from triton.runtime.driver import driver
from flexplan.aot import direct, launch_abi, runtime
from flexplan.aot.specialize import Specializer, _example
from flexplan.aot.variants import enumerate_variants

logging.basicConfig(level=logging.WARNING, format="LOG %(message)s", stream=sys.stdout)
# A fake sm_90 device: Triton's binder and the bundle lookup run for real, the driver calls are
# recorded. This Triton's kernels have Triton 3.6's parameter ABI (test above), so allow it here.
launch_abi.MIRRORED_VERSIONS = (triton.__version__,)
direct.libcuda = lambda: None
torch.cuda.current_device = lambda: 0
torch.cuda.get_device_capability = lambda device=None: (9, 0)
torch._C._cuda_getCurrentRawStream = lambda device: 1234
loads, launches, sizes = [], [], []

class RecordingKernel:
    def __init__(self, cubin, name, device, **settings):
        loads.append(dict(name=name, device=device, cubin_bytes=len(cubin), **settings))
        self.num_ctas = settings["num_ctas"]
    def launch(self, grid, stream, params):
        values = [int.from_bytes(ctypes.string_at(a, n), "little") for a, n in zip(params, sizes)]
        launches.append(dict(grid=list(grid), stream=stream, count=len(params), values=values))

direct.CudaKernel = RecordingKernel

def probe(bundle_dir):
    """The requests below against the bundle at bundle_dir, from runtime.reset() on."""
    manifest = {e["key"]: e for e in json.load(open(os.path.join(bundle_dir, "manifest.json")))["entries"]}
    loads.clear()
    launches.clear()

    def request(kernel, change=None):
        variant = next(v for v in enumerate_variants() if v.kernel == kernel)
        fn = getattr(importlib.import_module(variant.module), variant.attr)
        kwargs = dict(variant.constexprs, **(change or {}))
        entry = manifest.get(Specializer("sm_90").spec(variant)["key"], {})
        sizes[:] = entry.get("param_bytes", [])
        args = [_example(a) for a in variant.args]
        served = direct.launch(fn, (5, 2), args, kwargs) is not None
        signature = entry.get("signature", {})
        expected = [a.data_ptr() if isinstance(a, torch.Tensor) else a
                    for name, a in zip(fn.arg_names, args) if signature.get(name) != "constexpr"]
        return {"served": served, "expected": expected + [0, 0], "param_bytes": entry.get("param_bytes")}

    os.environ["FLEXPLAN_AOT_PATH"] = bundle_dir
    runtime.reset()
    out = {"wgrad": request("conv_wgrad"), "gemm": request("conv_gather_gemm"),
           "other_warps": request("conv_wgrad", {"num_warps": 2})}
    profiler = lambda *_: None  # noqa: E731
    triton.knobs.runtime.launch_enter_hook.add(profiler)  # a profiler: Triton must see launches
    out["profiled"] = request("conv_wgrad")
    triton.knobs.runtime.launch_enter_hook.remove(profiler)
    out.update(loads=list(loads), launches=list(launches), stats=dict(runtime.stats),
               triton_driver_started=driver._default is not None)
    return out

for scenario in sys.argv[1:]:  # NAME=BUNDLE_DIR: the LOG lines up to its RESULT line are its own
    name, path = scenario.split("=", 1)
    print("SCENARIO " + name, flush=True)
    print("RESULT " + json.dumps(probe(path)), flush=True)
'''


@pytest.fixture(scope="module")
def direct_probe(bundle, tmp_path_factory):
    """The direct launcher on a fake sm_90 device, one process for two bundles (name -> (result,
    LOG lines)): "old", the bundle with the parameter sizes gone from its manifest (an older
    build's), then "good", the bundle as built."""
    out, _ = bundle
    work = tmp_path_factory.mktemp("aot-direct")
    old = work / "old"
    shutil.copytree(out, old, ignore=shutil.ignore_patterns("specs", ".triton-cache"))
    manifest = _manifest(old)
    for e in manifest["entries"]:
        e.pop("param_bytes", None)
    (old / "manifest.json").write_text(json.dumps(manifest))
    proc = subprocess.run([sys.executable, "-c", _DIRECT_PROBE, f"old={old}", f"good={out}"],
                          cwd=REPO, capture_output=True, text=True, timeout=300,
                          env=_env(FLEXPLAN_CACHE_DIR=str(work / "cache")))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    found, name = {}, None
    for line in proc.stdout.splitlines():
        if line.startswith("SCENARIO "):
            name = line[len("SCENARIO "):]
            found[name] = (None, [])
        elif line.startswith("RESULT "):
            found[name] = (json.loads(line[len("RESULT "):]), found[name][1])
        elif line.startswith("LOG "):
            found[name][1].append(line)
    assert list(found) == ["old", "good"] and all(r is not None for r, _ in found.values()), proc.stdout
    return found


def test_direct_launch_passes_the_binarys_parameters(direct_probe):
    result, _ = direct_probe["good"]
    assert result["wgrad"]["served"] and result["gemm"]["served"]
    assert result["other_warps"]["served"] is False  # not in the bundle: left to Triton's JIT
    assert result["profiled"]["served"] is False  # launch hooks set: left to Triton's launcher
    assert not result["triton_driver_started"]  # no Triton launcher, no cuda_utils build
    assert result["stats"] == {"aot": 2, "direct": 2}
    assert [load["name"] for load in result["loads"]] == ["conv_wgrad_kernel", "conv_gather_gemm_kernel"]
    for load in result["loads"]:
        assert load["cubin_bytes"] > 0 and load["shared"] > 0 and load["num_warps"] in (1, 2, 4, 8)
        assert load["num_ctas"] == 1 and not load["cooperative"] and not load["pdl"]
    for request, launch in zip((result["wgrad"], result["gemm"]), result["launches"]):
        assert launch["grid"] == [5, 2, 1] and launch["stream"] == 1234
        assert launch["count"] == len(request["param_bytes"]) == len(request["expected"])
        assert launch["values"] == request["expected"]  # pointers, ints, then two null scratch pointers


def test_direct_launch_refuses_an_entry_without_parameter_sizes(direct_probe):
    result, logs = direct_probe["old"]
    assert not result["wgrad"]["served"] and not result["gemm"]["served"] and result["loads"] == []
    lines = [line for line in logs if "launching it through Triton's launcher" in line]
    assert len(lines) == 2 and "no parameter layout" in lines[0], logs
