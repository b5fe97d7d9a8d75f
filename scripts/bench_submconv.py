"""Submanifold conv (3x3x3) speed: flexplan vs spconv 2.3 SubMConv3d, in one GPU run.

Sphere-shell workloads, fp16 and tf32, forward and forward+backward. Both sides reuse their
index pairs (plans): only the convolution is timed (triton.testing.do_bench, median ms).
Effective TFLOP/s = 2 * pairs * Ci * Co / time (x3 for forward+backward), next to the measured
dense torch.mm rate of the same dtype. Accuracy: forward relative error vs float64 (max |err| /
max |ref|). Writes scripts/results/bench_submconv.md.

Usage: python scripts/bench_submconv.py [--quick] [--no-1024] [--cases R:C,...] [--algos [--sweep R:C,...]]
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch
import triton
from triton.testing import do_bench

from flexplan import ConvGeometry, build_plan
from flexplan.ops import sparse_conv
from flexplan.ops.conv import _gather_gemm, _resolve_algo, _wgrad, _dtype_name
from flexplan.plan import MISSING
from flexplan.workloads import sphere_shell

from bench_common import dense_tflops, today

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "bench_submconv.md")
DATE = today()
CASES_WIDE = [(16, 1024), (32, 1024), (64, 1024), (128, 512), (256, 256)]
CASES_LARGE = [(r, c) for r in (256, 512, 1024) for c in (32, 64, 128)]
DTYPES = {"fp16": (torch.float16, False), "tf32": (torch.float32, True)}


def bench(fn, rep=60):
    return do_bench(fn, warmup=15, rep=rep, return_mode="median")


def make_plan(coords, r):
    geometry = ConvGeometry.submanifold_conv(3)
    try:
        return build_plan(coords, (r, r, r), 1, geometry, check=False)
    except Exception as exc:  # the GPU planner failed: the torch planner (same plan) instead
        print(f"GPU planner failed ({type(exc).__name__}: {exc}); using the torch planner")
        return build_plan(coords, (r, r, r), 1, geometry, backend="torch", check=False)


def reference_fwd(feats, plan, weight):
    """float64 gather reference (offset by offset, in place to bound memory)."""
    f64, w64 = feats.double(), weight.double().reshape(weight.shape[0], -1, weight.shape[-1])
    out = torch.zeros(plan.num_out, weight.shape[0], dtype=torch.float64, device=feats.device)
    nmap = plan.fwd.neighbor_map
    for v in range(nmap.shape[1]):
        rows = (nmap[:, v] != MISSING).nonzero()[:, 0]
        out.index_add_(0, rows, f64[nmap[rows, v].long()] @ w64[:, v].t())
    return out


def rel_err(got, ref):
    got, ref = got.detach().double(), ref.detach().double()
    return float((got - ref).abs().max() / ref.abs().max())


def peak_mb(fn):
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2 ** 20


class SpconvSide:
    """spconv SubMConv3d with its index pairs built once and reused by every timed call."""

    def __init__(self, coords, r, ci, co, dtype, allow_tf32, weight):
        import spconv.constants
        import spconv.pytorch as spconv

        spconv.constants.SPCONV_ALLOW_TF32 = allow_tf32
        self.spconv = spconv
        self.conv = spconv.SubMConv3d(ci, co, 3, bias=False, indice_key="bench").cuda().to(dtype)
        with torch.no_grad():  # KRSC [Co, k0, k1, k2, Ci], our layout; axes (x, y, z) -> (d0, d1, d2)
            self.conv.weight.copy_(weight)
        self.coords, self.r = coords, r
        self.x = None

    def tensor(self, feats):
        x = self.spconv.SparseConvTensor(feats, self.coords, [self.r] * 3, 1)
        if self.x is not None:
            x.indice_dict = self.x.indice_dict  # reuse the pairs
        return x

    def forward(self, feats):
        x = self.tensor(feats)
        out = self.conv(x)
        if self.x is None:
            self.x = x
            self.x.indice_dict = out.indice_dict
        return out.features


def run_case(r, c, dtype_name, coords, plan, rates, check_error, results):
    dtype, tf32 = DTYPES[dtype_name]
    n = coords.shape[0]
    gen = torch.Generator(device="cuda").manual_seed(r * 7 + c)
    feats = torch.randn(n, c, device="cuda", generator=gen).to(dtype)
    weight = (torch.randn(c, 3, 3, 3, c, device="cuda", generator=gen) / math.sqrt(27 * c)).to(dtype)
    grad = torch.randn(n, c, device="cuda", generator=gen).to(dtype)
    feats_g = feats.clone().requires_grad_()
    weight_g = weight.clone().requires_grad_()

    def ours_fwd():
        return sparse_conv(feats, plan, weight, algo="auto", allow_tf32=tf32)

    def ours_fwdbwd():
        out = sparse_conv(feats_g, plan, weight_g, algo="auto", allow_tf32=tf32)
        out.backward(grad)

    row = dict(R=r, C=c, N=n, pairs=plan.num_pairs, dtype=dtype_name)
    out = ours_fwd()
    if check_error:
        ref = reference_fwd(feats, plan, weight)
        row["err"] = rel_err(out, ref)
        del ref
    del out
    row["fwd"] = bench(ours_fwd)
    row["fwdbwd"] = bench(lambda: ours_fwdbwd())
    row["mem"] = peak_mb(ours_fwdbwd)
    torch.backends.cuda.matmul.allow_tf32 = tf32
    try:
        ours = ours_fwd().double()
        side = SpconvSide(coords, r, c, c, dtype, tf32, weight)
        row["sp_err_vs_ours"] = rel_err(side.forward(feats), ours)
        if row["sp_err_vs_ours"] > 0.05:  # spconv's offsets the other way round: flip the kernel
            with torch.no_grad():
                side.conv.weight.copy_(weight.flip(1, 2, 3))
            row["sp_err_vs_ours"] = rel_err(side.forward(feats), ours)
            row["sp_flipped"] = True
        del ours
        sp_feats = feats.clone().requires_grad_()

        def sp_fwdbwd():
            side.forward(sp_feats).backward(grad)

        row["sp_fwd"] = bench(lambda: side.forward(feats))
        row["sp_fwdbwd"] = bench(sp_fwdbwd)
        row["sp_mem"] = peak_mb(sp_fwdbwd)
    except Exception as exc:  # report, keep benchmarking our side
        row["sp_error"] = f"{type(exc).__name__}: {exc}"[:120]
    finally:
        torch.backends.cuda.matmul.allow_tf32 = False
    # Our per-part times, for tuning.
    v = 27
    part = {}
    w3 = weight.reshape(c, v, c)
    for name, fn in (
        ("dgrad", lambda a: _gather_gemm(grad, w3, None, plan.fwd, True, "dgrad", a, tf32)),
        ("wgrad", lambda a: _wgrad(grad, feats, plan, (c, v, c), a, tf32)),
    ):
        algo = _resolve_algo("auto", name, n if name == "dgrad" else plan.num_pairs, c, c, v,
                             _dtype_name(dtype, tf32))
        part[name] = (algo, bench(lambda: fn(algo), rep=30))
    row["fwd_algo"] = _resolve_algo("auto", "fwd", n, c, c, v, _dtype_name(dtype, tf32))
    row["parts"] = part
    flops = 2 * plan.num_pairs * c * c
    row["tflops_fwd"] = flops / row["fwd"] / 1e9
    row["tflops_fwdbwd"] = 3 * flops / row["fwdbwd"] / 1e9
    row["dense"] = rates[dtype_name]
    results.append(row)
    sp = (f"sp {row['sp_fwd']:.3f}/{row['sp_fwdbwd']:.3f} ms x{row['sp_fwd']/row['fwd']:.2f}/"
          f"x{row['sp_fwdbwd']/row['fwdbwd']:.2f}" if "sp_fwd" in row else row.get("sp_error"))
    print(f"R={r:5d} C={c:5d} {dtype_name} N={n} fwd {row['fwd']:.3f} ({row['fwd_algo']}) "
          f"fwdbwd {row['fwdbwd']:.3f} ms; {row['tflops_fwd']:.0f}/{row['tflops_fwdbwd']:.0f} TF/s; "
          f"dgrad {part['dgrad'][1]:.3f} ({part['dgrad'][0]}) wgrad {part['wgrad'][1]:.3f} "
          f"({part['wgrad'][0]}); err {row.get('err', float('nan')):.1e} "
          f"sp~ours {row.get('sp_err_vs_ours', float('nan')):.1e}; {sp}", flush=True)


def algo_sweep(cases):
    """Every algorithm on a few cases (fp16): what 'auto' should pick."""
    lines = []
    for r, c in cases:
        coords = sphere_shell(r, 1, "cuda")
        plan = make_plan(coords, r)
        feats = torch.randn(coords.shape[0], c, device="cuda", dtype=torch.float16)
        weight = torch.randn(c, 3, 3, 3, c, device="cuda", dtype=torch.float16) / math.sqrt(27 * c)
        grad = torch.randn_like(feats)
        times = []
        for algo in ("explicit", "implicit", "implicit_splitk", "masked", "masked_splitk", "auto"):
            fg, wg = feats.clone().requires_grad_(), weight.clone().requires_grad_()
            try:
                fwd = bench(lambda: sparse_conv(feats, plan, weight, algo=algo), rep=30)
                fb = bench(lambda: sparse_conv(fg, plan, wg, algo=algo).backward(grad), rep=30)
                times.append(f"{algo} {fwd:.3f}/{fb:.3f}")
            except torch.OutOfMemoryError:
                times.append(f"{algo} OOM")
                torch.cuda.empty_cache()
        for algo in ("explicit", "auto"):  # grad-weight alone: what auto should pick for it
            wg = _resolve_algo(algo, "wgrad", plan.num_pairs, c, c, 27, "float16")
            ms = bench(lambda: _wgrad(grad, feats, plan, (c, 27, c), wg, False), rep=30)
            times.append(f"wgrad {algo} ({wg}) {ms:.3f}")
        line = f"R={r} C={c} fp16 fwd/fwd+bwd ms: " + ", ".join(times)
        print(line, flush=True)
        lines.append(line)
    return lines


def geomean(xs):
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def write_markdown(results, rates, sweep, header, quiet=False):
    lines = [f"# bench_submconv: flexplan SubMConv3d (3x3x3) vs spconv 2.3", "", *header, "",
             f"Dense torch.mm 8192^3: fp16 {rates['fp16']:.0f} TFLOP/s, tf32 {rates['tf32']:.0f} TFLOP/s.",
             "Times: median ms (triton.testing.do_bench); speedup = spconv time / flexplan time; "
             "TF/s = effective 2*pairs*Ci*Co/time (x3 for fwd+bwd); mem = peak extra MiB of fwd+bwd; "
             "err = fwd max|err|/max|ref| vs float64; sp~ours = the same measure of spconv's output "
             "against ours.", "",
             "| R | C | dtype | N | fwd ms | sp fwd ms | x fwd | fwd+bwd ms | sp fwd+bwd ms | x fwd+bwd "
             "| TF/s fwd | TF/s fwd+bwd | % dense fwd | mem MiB | sp mem MiB | err | sp~ours | algo fwd/dgrad/wgrad |",
             "|" + "---|" * 18]
    for row in results:
        f = lambda k, fmt=".3f": format(row[k], fmt) if k in row else "-"  # noqa: E731
        x_fwd = f"{row['sp_fwd'] / row['fwd']:.2f}" if "sp_fwd" in row else "-"
        x_fb = f"{row['sp_fwdbwd'] / row['fwdbwd']:.2f}" if "sp_fwdbwd" in row else "-"
        algos = f"{row['fwd_algo']}/{row['parts']['dgrad'][0]}/{row['parts']['wgrad'][0]}"
        lines.append(
            f"| {row['R']} | {row['C']} | {row['dtype']} | {row['N']} | {f('fwd')} | {f('sp_fwd')} "
            f"| {x_fwd} | {f('fwdbwd')} | {f('sp_fwdbwd')} | {x_fb} | {row['tflops_fwd']:.0f} "
            f"| {row['tflops_fwdbwd']:.0f} | {100 * row['tflops_fwd'] / row['dense']:.0f}% "
            f"| {f('mem', '.0f')} | {f('sp_mem', '.0f')} | {f('err', '.1e')} "
            f"| {f('sp_err_vs_ours', '.1e')} | {algos} |")
    lines.append("")
    for dtype_name in DTYPES:
        rows = [r for r in results if r["dtype"] == dtype_name and "sp_fwd" in r]
        fx = [r["sp_fwd"] / r["fwd"] for r in rows]
        bx = [r["sp_fwdbwd"] / r["fwdbwd"] for r in rows]
        if rows:
            lines.append(f"- {dtype_name}: geomean speedup vs spconv fwd {geomean(fx):.2f}x "
                         f"(min {min(fx):.2f}x), fwd+bwd {geomean(bx):.2f}x (min {min(bx):.2f}x) "
                         f"over {len(rows)} cases")
    errors = [r for r in results if "sp_error" in r]
    for r in errors:
        lines.append(f"- spconv failed at R={r['R']} C={r['C']} {r['dtype']}: {r['sp_error']}")
    if sweep:
        lines += ["", "Algorithm sweep (fp16):", ""] + [f"- {s}" for s in sweep]
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with open(RESULTS, "w") as fh:
        fh.write("\n".join(lines) + "\n")
    if not quiet:
        print("\n".join(lines[-8:]))


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="a few small cases")
    parser.add_argument("--no-1024", action="store_true")
    parser.add_argument("--algos", action="store_true", help="also sweep every algorithm")
    parser.add_argument("--sweep", default="32:1024,256:64,512:32", help="R:C cases of --algos")
    parser.add_argument("--cases", help="R:C,... instead of the issue's grid")
    parser.add_argument("--dtypes", default="fp16,tf32")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_submconv needs a GPU")
        return 1
    try:
        import spconv
        sp_version = spconv.__version__
    except ImportError:
        sp_version = "not installed"
    header = [f"GPU: {torch.cuda.get_device_name()}; torch {torch.__version__}; Triton "
              f"{triton.__version__}; spconv {sp_version}; date {DATE}."]
    rates = {name: dense_tflops(*DTYPES[name]) for name in DTYPES}
    header[0] += f" Dense fp16 torch.mm {rates['fp16']:.0f} TFLOP/s (the GPU's state in this run)."
    print(header[0], flush=True)
    cases = [(16, 1024), (64, 256), (128, 64)] if args.quick else CASES_WIDE + [
        rc for rc in CASES_LARGE if not (args.no_1024 and rc[0] == 1024)]
    if args.cases:
        cases = [tuple(map(int, rc.split(":"))) for rc in args.cases.split(",")]
    results = []
    start = time.time()
    # Warm-up, discarded: whatever case ran first measured slower than the same case again
    # (H100, R=16 C=1024 fp16 fwd+bwd: 0.84-0.87 ms first, 0.61 ms repeated), which would
    # count against flexplan only (each case times flexplan before spconv).
    warm_coords = sphere_shell(cases[0][0], 1, "cuda")
    run_case(*cases[0], args.dtypes.split(",")[0], warm_coords, make_plan(warm_coords, cases[0][0]),
             rates, False, [])
    warm_coords = None
    for r, c in cases:
        try:
            coords = sphere_shell(r, 1, "cuda")
            plan = make_plan(coords, r)
            for dtype_name in args.dtypes.split(","):
                run_case(r, c, dtype_name, coords, plan, rates, r <= 512, results)
            write_markdown(results, rates, [], header, quiet=True)  # partial results survive
        except torch.OutOfMemoryError as exc:
            print(f"R={r} C={c}: out of memory ({exc})"[:200], flush=True)
        finally:
            coords = plan = None
            torch.cuda.empty_cache()
    sweep = algo_sweep([tuple(map(int, rc.split(":"))) for rc in args.sweep.split(",")]) if args.algos else []
    print(f"total {time.time() - start:.0f} s")
    write_markdown(results, rates, sweep, header)
    return 0


if __name__ == "__main__":
    sys.exit(main())
