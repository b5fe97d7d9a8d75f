"""The first training step of a fresh process, with and without an AOT bundle: what a training
job or an inference server waits before its steady state (issue #23's targets).

Each (network, mode) runs in a new process that counts Triton compilations from its very start
(triton.knobs.runtime.jit_post_compile_hook) and measures:
- floor: interpreter start, imports (torch, flexplan) and CUDA context: what no kernel work
  can beat;
- first: the first train step (fresh LiDAR batch, the e2e networks of bench_e2e.py);
- steady: the median train step after a warm-up, on fresh coordinates;
- then inference steps and repeated-coordinate steps, whose compilations are counted too.
Target: first <= 1.5 x steady (+ the floor, measured apart), 0 compilations with the bundle.

Usage (GPU): python3 scripts/bench_first_step.py [--bundle DIR] [--networks encoder,unet]
                 [--modes fp16,bf16,fp32,amp-fp16] [--steps 15]
--bundle: an AOT bundle directory (python -m aot --out DIR); it is handed to the child processes
through FLEXPLAN_AOT_PATH. Without it the kernels JIT-compile (into a new empty Triton cache
per process, so every run compiles as a new machine would).
Writes scripts/results/bench_first_step.md.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent
sys.path.insert(0, str(SCRIPTS))


def child(args) -> None:
    t0 = float(os.environ["BENCH_T0"])
    from triton import knobs

    compiled: list[str] = []
    knobs.runtime.jit_post_compile_hook = lambda **kw: compiled.append(kw["fn"].name)
    import torch

    import flexplan.nn.spconv as sp
    from flexplan.aot import runtime
    from bench_e2e import MODES, BatchSource, build_model, infer_step_fn, sizes_for, train_step_fn
    from e2e_networks import NETWORKS
    from bench_common import time_call

    device = torch.device("cuda")
    torch.zeros(1, device=device)
    torch.cuda.synchronize()
    floor = time.time() - t0
    mode = MODES[args.mode]
    sizes = sizes_for(False)
    source = BatchSource(argparse.Namespace(batch=2, seed=0), sizes, device)
    batches = source.take(args.steps + 1, mode.input_dtype)
    net = build_model(NETWORKS[args.network], sp, None, mode, sizes, device)
    step = train_step_fn(net, sp, mode, device)

    times = [time_call(step, b) for b in batches[:args.steps]]
    train_compiles = len(compiled)
    infer = infer_step_fn(net, sp, mode, device)
    for b in source.take(3, mode.input_dtype):
        time_call(infer, b)
    infer_compiles = len(compiled) - train_compiles
    same = batches[-1]
    for fn in (train_step_fn(net, sp, mode, device), infer_step_fn(net, sp, mode, device)):
        for _ in range(2):
            time_call(fn, same)
    warm = times[len(times) // 3:]
    result = dict(network=args.network, mode=args.mode, floor_s=floor, first_ms=times[0],
                  second_ms=times[1], steady_ms=statistics.median(warm),
                  compiles_train=train_compiles, compiles_infer=infer_compiles,
                  compiles_total=len(compiled), compiled=sorted(set(compiled)),
                  aot_loaded=runtime.stats["aot"], aot_direct=runtime.stats["direct"])
    Path(args.save).write_text(json.dumps(result))


def spawn(network: str, mode: str, bundle: str | None, steps: int) -> dict:
    save = Path(tempfile.mkdtemp(prefix="first-step-")) / "result.json"
    env = dict(os.environ, BENCH_T0=repr(time.time()),
               TRITON_CACHE_DIR=tempfile.mkdtemp(prefix="triton-cache-"),
               FLEXPLAN_CACHE_DIR=tempfile.mkdtemp(prefix="flexplan-cache-"))
    env.pop("FLEXPLAN_AOT_PATH", None)
    if bundle:
        env["FLEXPLAN_AOT_PATH"] = str(Path(bundle).resolve())
    cmd = [sys.executable, __file__, "--child", "--network", network, "--mode", mode,
           "--steps", str(steps), "--save", str(save)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{network} {mode} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return json.loads(save.read_text())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bundle", default=None)
    parser.add_argument("--networks", default="encoder,unet")
    parser.add_argument("--modes", default="fp16,bf16,fp32,amp-fp16")
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--out", default=str(SCRIPTS / "results" / "bench_first_step.md"))
    parser.add_argument("--child", action="store_true")
    parser.add_argument("--network")
    parser.add_argument("--mode")
    parser.add_argument("--save")
    args = parser.parse_args()
    if args.child:
        return child(args)
    import torch
    import triton

    from bench_common import today

    rows = []
    for network in args.networks.split(","):
        for mode in args.modes.split(","):
            row = spawn(network, mode, args.bundle, args.steps)
            rows.append(row)
            print(json.dumps(row), flush=True)
    lines = [f"# First training step of a fresh process ({today()})", "",
             f"GPU {torch.cuda.get_device_name()}; torch {torch.__version__}, Triton "
             f"{triton.__version__}. Bundle: {args.bundle or 'none (JIT, empty Triton cache)'}.",
             "Each row: a new process, a new empty Triton cache and plan cache; fresh LiDAR batches "
             f"(batch 2); {args.steps} train steps, steady = median of the last two thirds; then "
             "3 inference steps and 2 + 2 repeated-coordinate steps (their compilations counted).",
             "", "| network | mode | floor s | first ms | second ms | steady ms | first / steady | "
             "compiles train / infer / all | AOT binaries (direct) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['network']} | {r['mode']} | {r['floor_s']:.2f} | {r['first_ms']:.0f} | "
                     f"{r['second_ms']:.1f} | {r['steady_ms']:.1f} | "
                     f"{r['first_ms'] / r['steady_ms']:.2f} | {r['compiles_train']} / "
                     f"{r['compiles_infer']} / {r['compiles_total']} | {r['aot_loaded']} "
                     f"({r['aot_direct']}) |")
    missing = sorted({k for r in rows for k in r["compiled"]})
    lines += ["", f"Kernels compiled by the JIT: {', '.join(missing) or 'none'}."]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
