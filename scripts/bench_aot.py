"""AOT vs JIT start-up on the GPU: time from process start to the first finished SubMConv3d
forward + backward, Triton compilations counted, results compared.

    python scripts/bench_aot.py [--bundle DIR] [--resolution 96] [--channels 32]

Without --bundle it builds one for this GPU first, timed
(`python -m aot --targets <this GPU> --channels <the benchmark's width>`).
Before timing, one untimed process runs the workload and every package it imported is
byte-compiled (python -m compileall), as a pip install does at install time: the GPU image ships
its venv without .pyc files (and sets PYTHONDONTWRITEBYTECODE=1), which would otherwise charge
seconds of Python compilation to every mode.
Then three fresh processes, each with its own empty TRITON_CACHE_DIR unless warm:
  aot       the bundle (FLEXPLAN_AOT_PATH), nothing else
  jit-cold  FLEXPLAN_AOT=0, empty Triton cache
  jit-warm  FLEXPLAN_AOT=0, the cache jit-cold left behind
Each runs forward + backward for every dtype (the plan is built on the GPU, planner kernels
included) and saves the results; AOT must compile nothing (no Triton compilation, no host C
build of a Triton launcher) and match JIT bitwise (printed as PASS / FAIL).
Writes scripts/results/bench_aot.md.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_common import today

REPO = Path(__file__).resolve().parent.parent
DTYPES = ("float16", "bfloat16", "float32", "tf32", "float64")
DATE = today()


def count_host_builds() -> list:
    """Names of the C modules Triton compiles with the host compiler in this process (its
    launchers and cuda_utils under Triton 3.6), recorded by wrapping triton.runtime.build._build."""
    from triton.runtime import build

    builds = []
    real = build._build

    def counting(name, *args, **kwargs):
        builds.append(name)
        return real(name, *args, **kwargs)

    build._build = counting
    return builds


def import_roots() -> list[str]:
    """What to byte-compile for this process's imports: the top-level package (or module) of
    every module loaded from source, as pip compiles whole packages; a file outside its top-level
    package's directory (flexplan.kernels_src) on its own."""
    roots = set()
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        if not file or not file.endswith(".py"):
            continue
        top = getattr(sys.modules.get(name.partition(".")[0]), "__file__", None) or file
        root = os.path.dirname(top) if top.endswith("__init__.py") else top
        roots.add(root if file == root or file.startswith(root + os.sep) else file)
    return sorted(roots)


def count_source_compiles() -> list:
    """Source files this process compiles on import (no usable .pyc), recorded by wrapping the
    import system's SourceFileLoader.source_to_code."""
    from importlib.machinery import SourceFileLoader

    compiled = []
    real = SourceFileLoader.source_to_code

    def counting(self, data, path, *args, **kwargs):
        compiled.append(path)
        return real(self, data, path, *args, **kwargs)

    SourceFileLoader.source_to_code = counting
    return compiled


def child(args) -> None:
    """One measured process: everything from here counts towards the start-up time."""
    t0 = float(os.environ["BENCH_T0"])
    from_source = count_source_compiles()
    from triton import knobs

    compiled = []
    knobs.runtime.jit_post_compile_hook = lambda **kw: compiled.append(kw["fn"].name)
    host_builds = count_host_builds()
    import torch

    from flexplan import SparseTensor
    from flexplan.aot import runtime
    from flexplan.nn.submconv import SubMConv3d
    from flexplan.workloads import sphere_shell

    device = torch.device("cuda")
    torch.zeros(1, device=device)
    ready = time.time() - t0  # interpreter, imports, CUDA context: the floor no kernel work can beat
    res = args.resolution
    coords = sphere_shell(res, device=device)
    results, first = {}, None
    for dtype_name in DTYPES:
        dtype = torch.float32 if dtype_name == "tf32" else getattr(torch, dtype_name)
        gen = torch.Generator(device="cpu").manual_seed(1)
        feats = torch.randn(len(coords), args.channels, generator=gen).to(device, dtype).requires_grad_()
        torch.manual_seed(2)
        conv = SubMConv3d(args.channels, args.channels, allow_tf32=dtype_name == "tf32",
                          device=device, dtype=dtype)
        try:
            out = conv(SparseTensor(feats, coords, (res, res, res), 1)).feats
            grad = torch.randn(out.shape, generator=gen).to(device, dtype)
            out.backward(grad)
            torch.cuda.synchronize()
        except Exception as exc:  # e.g. a dtype this Triton cannot compile: same in every mode
            results[dtype_name] = f"{exc.__class__.__name__}: {str(exc).strip().splitlines()[-1][:120]}"
            continue
        if first is None:
            first = time.time() - t0
        results[dtype_name] = [t.detach().cpu() for t in (out, feats.grad, conv.weight.grad, conv.bias.grad)]
    total = time.time() - t0
    torch.save({"results": results, "first": first, "total": total, "compiled": compiled, "ready": ready,
                "host_builds": host_builds, "aot_loaded": runtime.stats["aot"], "direct": runtime.stats["direct"],
                "from_source": len(from_source), "import_roots": import_roots(), "voxels": len(coords)}, args.save)


def spawn(mode: str, save: Path, env: dict, args) -> dict:
    import torch

    cmd = [sys.executable, __file__, "--child", "--save", str(save),
           "--resolution", str(args.resolution), "--channels", str(args.channels)]
    env = dict(env, BENCH_T0=repr(time.time()))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{mode} run failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    data = torch.load(save)
    data["log"] = [line for line in proc.stderr.splitlines() if "flexplan.aot" in line]
    return data


def build_bundle(target: str, channels: int) -> tuple[Path, float, str]:
    """The bundle for this GPU, narrowed to the benchmark's layer width (device time is scarce)."""
    out = REPO / "aot_bundle"
    start = time.time()
    proc = subprocess.run([sys.executable, "-m", "aot", "--targets", target, "--channels", str(channels),
                           "--out", str(out), "-j", str(os.cpu_count() or 1)],
                          cwd=REPO, capture_output=True, text=True)
    lines = proc.stdout.splitlines()
    if proc.returncode != 0:
        raise SystemExit("AOT build failed:\n" + "\n".join(lines[-20:]) + proc.stderr[-3000:])
    summary = [line for line in lines if line.startswith("aot: ") and "does not compile:" not in line]
    return out, time.time() - start, " / ".join(summary)


def byte_compile(roots: list[str]) -> tuple[float, int]:
    """python -m compileall over the measured process's imports: (seconds, exit status)."""
    start = time.time()
    rc = subprocess.call([sys.executable, "-m", "compileall", "-q", "-j", "0", *roots],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.time() - start, rc


BOTH_FAIL = "both fail the same way"


def bitwise_equal(aot, jit) -> str:
    """"equal" / "DIFFERENT" for two runs' result tensors, or how they failed."""
    if isinstance(aot, str) or isinstance(jit, str):
        if aot == jit:
            return BOTH_FAIL
        return f"failed (AOT: {aot if isinstance(aot, str) else 'ok'}; JIT: {jit if isinstance(jit, str) else 'ok'})"
    import torch

    same = all(torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
               for a, b in zip(aot, jit))
    return "equal" if same else "DIFFERENT"


def bundle_bytes(bundle: Path) -> int:
    import json

    manifest = json.loads((bundle / "manifest.json").read_text())
    files = [bundle / "manifest.json"] + [bundle / e[k] for e in manifest["entries"] for k in ("file", "metadata")]
    return sum(f.stat().st_size for f in files)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bundle", type=Path)
    parser.add_argument("--resolution", type=int, default=96)
    parser.add_argument("--channels", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--child", action="store_true")
    parser.add_argument("--save", type=Path)
    args = parser.parse_args()
    if args.child:
        return child(args)

    import torch
    import triton
    from triton.runtime.driver import driver

    from flexplan.aot.keys import target_name

    target = target_name(driver.active.get_current_target())
    build_s, build_line = None, ""
    if args.bundle is None:
        args.bundle, build_s, build_line = build_bundle(target, args.channels)
    work = Path(tempfile.mkdtemp(prefix="bench_aot_"))
    base = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "FLEXPLAN_AOT_PATH")}
    base["FLEXPLAN_CACHE_DIR"] = str(work / "flexplan-cache")  # no user-cache bundles, no plan cache
    # Untimed: run the workload once (libraries into the OS file cache, the list of what it
    # imports), then byte-compile those packages, as installing them with pip would have.
    warmup = spawn("warm-up", work / "warmup.pt", dict(base, TRITON_CACHE_DIR=str(work / "tc-warmup"),
                                                       FLEXPLAN_AOT_PATH=str(args.bundle)), args)
    compile_s, compile_rc = byte_compile(warmup["import_roots"])
    # Interleaved repeats (each with fresh empty caches) so no mode profits from running later.
    rounds = []
    for r in range(args.repeat):
        aot_env = dict(base, TRITON_CACHE_DIR=str(work / f"tc-aot{r}"), FLEXPLAN_AOT_PATH=str(args.bundle))
        jit_env = dict(base, TRITON_CACHE_DIR=str(work / f"tc-jit{r}"), FLEXPLAN_AOT="0")
        rounds.append({"aot": spawn("aot", work / f"aot{r}.pt", aot_env, args),
                       "jit-cold": spawn("jit-cold", work / f"cold{r}.pt", jit_env, args),
                       "jit-warm": spawn("jit-warm", work / f"warm{r}.pt", jit_env, args)})
    runs = rounds[0]
    bitwise = {d: bitwise_equal(runs["aot"]["results"][d], runs["jit-cold"]["results"][d]) for d in DTYPES}
    compared = [v for v in bitwise.values() if v != BOTH_FAIL]
    passed = bool(compared) and all(v == "equal" for v in compared)
    doctor = subprocess.run([sys.executable, "-m", "flexplan", "doctor"], capture_output=True, text=True,
                            env=dict(base, FLEXPLAN_AOT_PATH=str(args.bundle))).stdout

    name = torch.cuda.get_device_name()
    lines = [
        "# AOT kernels: start-up without JIT compilation", "",
        f"{name} ({target}), torch {torch.__version__}, Triton {triton.__version__}, {DATE}.",
        f"Workload: SubMConv3d {args.channels}->{args.channels}, 3x3x3, sphere shell R={args.resolution} "
        f"({runs['aot']['voxels']} voxels), plan built on the GPU; forward + backward for "
        f"{', '.join(DTYPES)}. Each mode is a fresh process.", "",
        "| mode | round | imports + CUDA init (s) | first fwd+bwd (s, from process start) | all dtypes (s) "
        "| Triton compilations | host C builds | AOT binaries loaded (launched directly) | modules from source |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r, round_runs in enumerate(rounds):
        for mode, data in round_runs.items():
            lines.append(f"| {mode} | {r + 1} | {data['ready']:.2f} | {data['first']:.2f} | {data['total']:.2f} "
                         f"| {len(data['compiled'])} | {len(data['host_builds'])} | {data['aot_loaded']} "
                         f"({data['direct']}) | {data['from_source']} |")
    lines += ["", f"AOT bitwise equal to JIT: {'PASS' if passed else 'FAIL'} (output, grad-input, grad-weight, "
              "grad-bias; " + "; ".join(f"{d} {v}" for d, v in bitwise.items()) + ")", "",
              f"Python byte-compiled before timing (`python -m compileall` over the {len(warmup['import_roots'])} "
              f"top-level packages / modules the workload imports, {compile_s:.0f} s, exit status {compile_rc}), as a "
              "pip install does; the GPU image's venv ships without .pyc files and sets PYTHONDONTWRITEBYTECODE=1. "
              "'modules from source': source files a timed process still compiled on import.",
              "'host C builds': Triton launcher / cuda_utils modules compiled with the host compiler "
              "(triton.runtime.build), into the empty TRITON_CACHE_DIR.", "",
              f"Bundle: {args.bundle.name}, {bundle_bytes(args.bundle) / 2**20:.1f} MiB"
              + (f"; built here in {build_s:.0f} s ({build_line})" if build_s else ""), ""]
    if runs["aot"]["compiled"] or runs["aot"]["host_builds"]:
        lines.append(f"Compiled despite AOT: kernels {sorted(set(runs['aot']['compiled']))}, "
                     f"host modules {sorted(set(runs['aot']['host_builds']))}")
    if runs["aot"]["log"]:
        lines += ["AOT log lines:", "```", *runs["aot"]["log"][:10], "```"]
    lines += ["`python -m flexplan doctor`:", "```", doctor.strip(), "```", ""]
    text = "\n".join(lines)
    print(text)
    results = REPO / "scripts" / "results"
    results.mkdir(parents=True, exist_ok=True)
    (results / "bench_aot.md").write_text(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "bench_aot.md").write_text(text)
    print(f"\nAOT_BITWISE_VS_JIT: {'PASS' if passed else 'FAIL'}")
    if not passed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
