"""Facts every benchmark records next to its numbers: the date, the GPU's measured state and the
host's speed; and the timers and row ordering the library comparisons share.

Scripts in this folder run as `python scripts/NAME.py`, so they import this module directly.
"""
from __future__ import annotations

import datetime


def today() -> str:
    """The run's date (UTC), so a results file says when its numbers were measured."""
    return datetime.datetime.now(datetime.timezone.utc).date().isoformat()


def dense_tflops(dtype=None, allow_tf32: bool = False, n: int = 8192) -> float:
    """Measured dense torch.mm rate (fp16 unless told): a shared or throttled GPU shows here first."""
    import torch
    from triton.testing import do_bench

    dtype = dtype or torch.float16
    a = torch.randn(n, n, device="cuda", dtype=dtype)
    b = torch.randn(n, n, device="cuda", dtype=dtype)
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = allow_tf32
    try:
        ms = do_bench(lambda: a @ b, warmup=25, rep=100, return_mode="median")
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous
    return 2 * n ** 3 / ms / 1e9


def host_launch_us(launches: int = 2000) -> float:
    """Host time of one small torch kernel launch (x.add_(1) on one element, median of 5 runs):
    builds that are host-bound (small plans) run as fast as this, and machines of one kind
    differ by 1.5x in it."""
    import statistics
    import time

    import torch

    x = torch.zeros(1, device="cuda")
    runs = []
    for _ in range(5):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(launches):
            x.add_(1)
        runs.append((time.perf_counter() - start) / launches * 1e6)
    torch.cuda.synchronize()
    return statistics.median(runs)


def host_times_us(calls) -> list:
    """Host microseconds of each callable in `calls`, the GPU drained before each (what one
    call costs the host when nothing is queued ahead of it)."""
    import time

    import torch

    times = []
    for call in calls:
        torch.cuda.synchronize()
        start = time.perf_counter()
        call()
        times.append((time.perf_counter() - start) * 1e6)
    torch.cuda.synchronize()
    return times


def sorted_rows(indices, feats):
    """feats in the order of their [N, 4] coordinates (libraries order outputs differently)."""
    import torch

    key = indices.long()
    flat = ((key[:, 0] * 4096 + key[:, 1]) * 4096 + key[:, 2]) * 4096 + key[:, 3]
    return feats[torch.argsort(flat)]


def time_call(step, b) -> float:
    """ms of step(b), synchronized before and after (the GPU's work included)."""
    import time

    import torch

    cuda = torch.cuda.is_available()  # (CPU smoke runs: nothing to wait for)
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    step(b)
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def time_steps(step, batches, warmup: int) -> float:
    """Median ms of step(b) over batches[warmup:], synchronized around each call, after
    step(b) for the first `warmup` batches."""
    import statistics

    for b in batches[:warmup]:
        step(b)
    return statistics.median([time_call(step, b) for b in batches[warmup:]])


def time_paired(steps: dict, batches, warmup: int, ratio: tuple[str, str] | None = None,
                failures: dict | None = None) -> dict:
    """Times several implementations of one step call by call on the same batches, so that
    host-speed drift moves them together instead of moving one block of calls against another.

    steps: {name: step}, each step(b) one call on batch b. First every step runs on each of
    batches[:warmup] (untimed); then, for each b in batches[warmup:], every step runs once on b,
    synchronized around each call (torch.cuda.synchronize before and after, perf_counter), the
    order rotated by one each batch (with two steps: which goes first alternates).

    Returns {"ms": {name: median ms}, "times": {name: [ms per timed batch]}, "ratio": the median
    over the timed batches of times[num][k] / times[den][k]}, where (num, den) = `ratio`, by
    default the first two names of `steps` (None with fewer than two steps).
    failures: a dict to note {name: exception} of a step that raises in a timed call (it then
    leaves the turns and the results; the ratio is None if it was one of the two); without
    it, the exception propagates."""
    import statistics

    names = list(steps)
    if not names or not batches[warmup:]:
        raise ValueError("time_paired: needs a step and a batch left to time after the warm-up")
    if ratio is None and len(names) >= 2:
        ratio = (names[0], names[1])

    def order(k: int) -> list:
        k %= len(names)
        return names[k:] + names[:k]

    for k, b in enumerate(batches[:warmup]):
        for name in order(k):
            steps[name](b)
    times = {name: [] for name in names}
    for k, b in enumerate(batches[warmup:]):
        for name in order(k):
            if name not in times:
                continue
            try:
                times[name].append(time_call(steps[name], b))
            except Exception as exc:
                if failures is None:
                    raise
                failures[name] = exc
                del times[name]
    paired = None
    if ratio is not None and all(name in times for name in ratio):
        num, den = ratio
        paired = statistics.median([a / b for a, b in zip(times[num], times[den])])
    return {"ms": {name: statistics.median(t) for name, t in times.items()}, "times": times,
            "ratio": paired}
