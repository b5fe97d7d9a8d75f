"""Developer sweep: time candidate kernel configs of each part on a few sphere-shell cases (fp16,
tf32), to set the heuristic defaults. One GPU call; prints the best per case and part."""
from __future__ import annotations

import argparse
import math
import sys

import torch
from triton.testing import do_bench

import importlib

sc = importlib.import_module("flexplan.ops.conv")
from flexplan import ConvGeometry, build_plan
from flexplan.kernel_configs import KernelConfig
from flexplan.workloads import sphere_shell

GEMM = [(128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 256, 64, 8, 3), (128, 128, 32, 4, 4),
        (128, 64, 64, 4, 4), (64, 128, 64, 4, 4), (128, 128, 128, 8, 3), (64, 64, 64, 4, 3),
        (128, 64, 32, 4, 3), (128, 32, 32, 4, 4), (64, 32, 32, 4, 3), (128, 32, 32, 4, 2),
        (64, 64, 32, 4, 4), (128, 128, 32, 8, 4)]
WGRAD = [(64, 4, 3), (128, 4, 3), (128, 8, 3), (256, 8, 2), (256, 8, 3), (128, 4, 4), (64, 4, 4),
         (256, 4, 3)]


def timed(fn):
    try:
        return do_bench(fn, warmup=5, rep=20, return_mode="median")
    except Exception as exc:  # e.g. out of shared memory
        if type(exc).__name__ not in _seen:
            _seen.add(type(exc).__name__)
            print(f"config failed: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
        return float("inf")


_seen: set = set()


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default="64:1024,256:256,512:128,512:64,512:32",
                        help="R:C pairs")
    parser.add_argument("--dtypes", default="fp16,tf32")
    parser.add_argument("--no-wgrad", action="store_true")
    args = parser.parse_args(argv)
    cases = [tuple(int(x) for x in rc.split(":")) for rc in args.cases.split(",")]
    dtypes = [d for d in [("fp16", torch.float16, False), ("tf32", torch.float32, True)]
              if d[0] in args.dtypes.split(",")]
    for r, c in cases:
        coords = sphere_shell(r, 1, "cuda")
        plan = build_plan(coords, (r,) * 3, 1, ConvGeometry.submanifold_conv(3), backend="torch",
                          check=False)
        for name, dtype, tf32 in dtypes:
            feats = torch.randn(coords.shape[0], c, device="cuda", dtype=dtype)
            w = (torch.randn(c, 27, c, device="cuda") / math.sqrt(27 * c)).to(dtype)
            res = {}
            for algo in ("implicit", "masked"):
                for bm, bn, bk, wp, st in GEMM:
                    if bn > max(c, 16) or bk > max(c, 16):
                        continue
                    cfg = KernelConfig(bm, bn, bk, 1, wp, st)
                    sc.select_config = lambda fam, prob, cfg=cfg: cfg
                    res[("fwd", algo, cfg)] = timed(lambda: sc._gather_gemm(
                        feats, w, None, plan.fwd, False, "fwd", algo, tf32))
            best = [(t, k) for k, t in sorted(res.items(), key=lambda kv: kv[1])[:3]]
            bf = best[0][1]
            sc.select_config = lambda fam, prob, cfg=bf[2]: cfg
            dg = timed(lambda: sc._gather_gemm(feats, w, None, plan.fwd, True, "dgrad", bf[1], tf32))
            wres = {}
            for bk, wp, st in ([] if args.no_wgrad else WGRAD):
                for s in (4, 8, 16, 32, 64):
                    bmn = min(128, max(16, c))
                    cfg = KernelConfig(bmn, bmn, bk, s, wp, st)
                    sc.select_config = lambda fam, prob, cfg=cfg: cfg
                    wres[cfg] = timed(lambda: sc._wgrad(feats, feats, plan, (c, 27, c), "masked_splitk", tf32))
            wbest = [(t, k) for k, t in sorted(wres.items(), key=lambda kv: kv[1])[:3]]
            print(f"R={r} C={c} {name}: fwd best " + "; ".join(
                f"{t:.3f} {k[1]} {k[2].block_m}x{k[2].block_n}x{k[2].block_k} w{k[2].num_warps} s{k[2].num_stages}"
                for t, k in best) + f" | dgrad(best fwd cfg) {dg:.3f} | wgrad best " + "; ".join(
                f"{t:.3f} {k.block_m}x{k.block_n}x{k.block_k} S{k.splitk} w{k.num_warps} s{k.num_stages}"
                for t, k in wbest), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
