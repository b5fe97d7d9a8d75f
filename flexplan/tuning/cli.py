"""`python -m flexplan tune`: measure the kernel configs on this GPU and save the table.

    python -m flexplan tune                     tune the default grid, merge into this GPU's table
    python -m flexplan tune --shells 64:256,128:64 --dtypes float16 --parts fwd
    python -m flexplan tune --shells 150:32:16          a shell with Ci 32 -> Co 16
    python -m flexplan tune --dtypes float32            tf32's buckets timed by float32's
                                                        3xTF32 kernels (NVIDIA; one config
                                                        serves both: name one of the two)
    python -m flexplan tune --out table.json    write there instead (e.g. a table to ship)
    python -m flexplan tune --show              where the tables are and what they hold
"""
from __future__ import annotations

import argparse
import time

from ..kernel_configs import PARTS
from .buckets import Bucket

# Sphere-shell (resolution, channels) pairs: few rows with many channels through many rows
# with few (the kernel benchmarks' grid).
DEFAULT_SHELLS = ((16, 1024), (32, 1024), (64, 1024), (128, 512), (256, 256),
                  (256, 32), (256, 64), (256, 128), (512, 32), (512, 64), (512, 128))
DEFAULT_DTYPES = ("float16", "tf32")


def _shells(text: str):
    """R:C (C channels in and out) or R:Ci:Co, comma separated -> ((R, Ci, Co), ...)."""
    try:
        shells = tuple(tuple(int(x) for x in item.split(":")) for item in text.split(",") if item)
    except ValueError:
        shells = ()
    if not shells or any(len(s) not in (2, 3) or min(s) < 1 for s in shells):
        raise argparse.ArgumentTypeError(f"expected R:C or R:Ci:Co[,...], got {text!r}")
    return _shells_of(shells)


def _names(text: str):
    return tuple(x for x in text.split(",") if x)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m flexplan tune", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shells", type=_shells, default=DEFAULT_SHELLS,
                   help="sphere shells R:C (grid resolution : channels in and out) or R:Ci:Co, "
                        "comma separated")
    p.add_argument("--dtypes", type=_names, default=DEFAULT_DTYPES,
                   help="e.g. float16,tf32; float32 tunes tf32's buckets (on NVIDIA) by the "
                        "3xTF32 kernels float32 models run (run-time tuning, FLEXPLAN_TUNE, "
                        "times those buckets with tf32's own kernels)")
    p.add_argument("--parts", type=_names, default=PARTS, help="fwd,dgrad,wgrad")
    p.add_argument("--algo", default="auto", help="algorithm to tune (auto: what 'auto' runs)")
    p.add_argument("--max-trials", type=int, default=32, help="configs measured per problem")
    p.add_argument("--warmup-ms", type=float, default=5.0)
    p.add_argument("--rep-ms", type=float, default=25.0)
    p.add_argument("--budget-s", type=float, default=None, help="stop tuning after this long")
    p.add_argument("--out", default=None, help="write the table here, not to the user cache")
    p.add_argument("--show", action="store_true", help="show the tables, tune nothing")
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("flexplan tune: no CUDA/ROCm GPU here; tables are per GPU")
        return 1
    from .device import device_key

    key = device_key(torch.cuda.current_device())
    if args.show:
        return show(key)
    from ..kernel_configs import config_dtype, runtime_is_hip

    if len({config_dtype(d, runtime_is_hip()) for d in args.dtypes}) < len(args.dtypes):
        print(f"flexplan tune: --dtypes {','.join(args.dtypes)} names one bucket's dtype twice "
              "(a dtype twice, or float32 and tf32, which share tf32's buckets on NVIDIA): "
              "name each once")
        return 2
    tuned = tune_grid(args, torch.device("cuda"))
    from .table import TuningTable, merge_into, user_table_path

    path = args.out or user_table_path(key)
    table = merge_into(path, TuningTable(key, {Bucket.of(t.problem): t.entry() for t in tuned}))
    print(f"{len(tuned)} problems tuned; {path} now holds {len(table.entries)} entries")
    return 0


def tune_grid(args, device) -> list:
    """Tune every (shell, dtype, part) of the arguments; one workload in memory at a time."""
    from .cases import part_case, shell_workload
    from .tuner import do_bench_median, tune_cases

    def bench(fn):
        return do_bench_median(fn, args.warmup_ms, args.rep_ms)

    deadline = None if args.budget_s is None else time.monotonic() + args.budget_s
    tuned = []
    for resolution, ci, co in _shells_of(args.shells):
        for dtype in args.dtypes:
            if deadline is not None and time.monotonic() >= deadline:
                print(f"time budget spent before shell R={resolution} Ci={ci} Co={co} {dtype}")
                return tuned
            work = shell_workload(resolution, ci, co, dtype, device)
            cases = [part_case(work, part, args.algo) for part in args.parts]
            tuned += tune_cases(cases, bench=bench, max_trials=args.max_trials, deadline=deadline)
            del work, cases
    return tuned


def _shells_of(shells) -> tuple:
    """(R, Ci, Co) per shell: R:C pairs (DEFAULT_SHELLS) mean C in and out."""
    return tuple(s if len(s) == 3 else (s[0], s[1], s[1]) for s in shells)


def show(key) -> int:
    from .dispatch import load_configs
    from .table import shipped_table_paths, user_table_path

    print(f"device: {key}")
    print(f"user table: {user_table_path(key)}"
          f"{'' if user_table_path(key).exists() else ' (none yet)'}")
    print("shipped tables: " + (", ".join(p.name for p in shipped_table_paths()) or "none"))
    configs = load_configs(key)
    print(f"{len(configs)} tuned buckets for this GPU")
    for bucket, config in sorted(configs.items(), key=lambda item: item[0].key):
        print(f"  {bucket.key:48s} {config}")
    return 0
