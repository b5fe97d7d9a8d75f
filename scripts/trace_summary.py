"""Summarize Chrome traces of torch.profiler's CUDA activity (scripts/bench_ddp.py --trace):
where a rank's window went on its GPU and in its CUDA API calls.

Usage: python3 scripts/trace_summary.py TRACE.json [TRACE.json ...] [--steps N]
       [--callers cudaMemcpyAsync]

Per trace: the window (first to last event), the GPU's busy time (the union of its kernels and
copies) and its NCCL kernels (count, time: a collective's kernel runs from when this rank's
stream reaches it until every rank's has, so its time is mostly waiting for the peers), and
the host's CUDA API calls by name (count, total, longest): synchronizations and blocking
copies are where the host waited for the GPU. --steps divides the totals per step.
--callers NAME (a trace with CPU activity and Python stacks, as profile_host.py --copies
records; bench_ddp --trace records CUDA activity only, where it finds nothing): the CUDA API
calls of that name by the op and the innermost Python frames around each.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
API_CATS = ("cuda_runtime", "cuda_driver")


def busy_us(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of [start, end) intervals."""
    total, end = 0.0, None
    for a, b in sorted(intervals):
        if end is None or a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


def summarize(path: str, steps: int) -> list[str]:
    with open(path) as f:
        events = [e for e in json.load(f).get("traceEvents", []) if e.get("ph") == "X"]
    if not events:
        return [f"{path}: no events"]
    start = min(e["ts"] for e in events)
    end = max(e["ts"] + e.get("dur", 0) for e in events)
    per = 1.0 / steps
    gpu = [(e["ts"], e["ts"] + e.get("dur", 0)) for e in events if e.get("cat") in GPU_CATS]
    nccl = [e for e in events if e.get("cat") == "kernel" and "nccl" in e.get("name", "").lower()]
    nccl_iv = [(e["ts"], e["ts"] + e.get("dur", 0)) for e in nccl]
    other = [(e["ts"], e["ts"] + e.get("dur", 0)) for e in events
             if e.get("cat") in GPU_CATS and "nccl" not in e.get("name", "").lower()]
    lines = [f"## {path}", "",
             f"window {(end - start) / 1e3 * per:.2f} ms per step ({steps} steps); GPU busy "
             f"{busy_us(gpu) / 1e3 * per:.2f} ms per step, of which outside NCCL kernels "
             f"{busy_us(other) / 1e3 * per:.2f}; NCCL kernels {len(nccl) * per:.1f} per step, "
             f"{busy_us(nccl_iv) / 1e3 * per:.2f} ms per step "
             f"({(busy_us(nccl_iv) / max(1, len(nccl))):.0f} us each)", "",
             "| CUDA API call | calls per step | ms per step | longest us |", "|---|---|---|---|"]
    calls: dict = defaultdict(list)
    for e in events:
        if e.get("cat") in API_CATS:
            calls[e.get("name", "?")].append(e.get("dur", 0))
    for name, durs in sorted(calls.items(), key=lambda kv: -sum(kv[1]))[:15]:
        lines.append(f"| {name} | {len(durs) * per:.1f} | {sum(durs) / 1e3 * per:.2f} | "
                     f"{max(durs):.0f} |")
    copies: dict = defaultdict(list)
    for e in events:
        if e.get("cat") in ("gpu_memcpy", "gpu_memset"):
            copies[e.get("name", "?")].append(e.get("dur", 0))
    if copies:
        lines += ["", "| GPU copy or set | per step | us each (mean) |", "|---|---|---|"]
        for name, durs in sorted(copies.items(), key=lambda kv: -len(kv[1])):
            lines.append(f"| {name} | {len(durs) * per:.1f} | {sum(durs) / len(durs):.1f} |")
    return lines + [""]


def callers(path: str, api: str, steps: int, frames: int = 4) -> list[str]:
    """The calls to `api` per step by (innermost op, innermost non-torch Python frames)."""
    import bisect

    with open(path) as f:
        events = [e for e in json.load(f).get("traceEvents", []) if e.get("ph") == "X"]
    around: dict = defaultdict(list)  # (pid, tid) -> containers sorted by start
    for e in events:
        if e.get("cat") in ("cpu_op", "python_function"):
            around[(e.get("pid"), e.get("tid"))].append(e)
    for lst in around.values():
        lst.sort(key=lambda e: e["ts"])
    starts = {k: [e["ts"] for e in v] for k, v in around.items()}
    counts: dict = defaultdict(int)
    for e in events:
        if e.get("cat") not in API_CATS or e.get("name") != api:
            continue
        key = (e.get("pid"), e.get("tid"))
        lst, ts = around.get(key, []), e["ts"]
        at = bisect.bisect_right(starts.get(key, []), ts)
        inside = [c for c in lst[max(0, at - 4000):at] if c["ts"] + c.get("dur", 0) >= ts]
        inside.sort(key=lambda c: c.get("dur", 0))
        op = next((c["name"] for c in inside if c.get("cat") == "cpu_op"), "-")
        chain = [c["name"] for c in inside if c.get("cat") == "python_function"
                 and "torch/" not in c["name"] and "<built-in" not in c["name"]][:frames]
        counts[(op, tuple(chain))] += 1
    lines = [f"## {api} by caller ({path})", ""]
    for (op, chain), n in sorted(counts.items(), key=lambda kv: -kv[1])[:30]:
        lines.append(f"- {n / steps:.1f} per step: {op} <- " + " <- ".join(chain))
    return lines + [""]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("traces", nargs="+")
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--callers", default="")
    args = parser.parse_args(argv)
    for path in args.traces:
        print("\n".join(summarize(path, max(1, args.steps))))
        if args.callers:
            print("\n".join(callers(path, args.callers, max(1, args.steps))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
