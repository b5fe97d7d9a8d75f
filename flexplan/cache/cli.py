"""`python -m flexplan cache {info,ls,verify,prune,clear}`: inspect and maintain the plan cache."""
from __future__ import annotations

import argparse
import time

from . import plan_cache
from .disk import verify_file
from .format import read_header
from .policy import parse_bytes


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""


def _describe(path) -> str:
    try:
        with open(path, "rb") as f:
            header, _ = read_header(f)
    except (OSError, ValueError) as exc:
        return f"(unreadable: {exc})"
    meta, geom = header.get("meta", {}), header.get("meta", {}).get("geometry", {})
    kind = "subm" if geom.get("submanifold") else ("transposed" if geom.get("transposed") else "conv")
    built = header.get("build_seconds")
    built = f" built {built * 1e3:.1f} ms on {header.get('built_on')}" if built else ""
    return (f"N={meta.get('num_in')} -> {meta.get('num_out')} {kind} k={geom.get('kernel_size')} "
            f"shape={meta.get('in_spatial_shape')} batch={meta.get('batch_size')}{built}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flexplan cache", description=__doc__)
    parser.add_argument("--dir", help="plan directory (default: $FLEXPLAN_CACHE_DIR/plans or the "
                                      "per-user cache directory)")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="directory, size, cap, mode")
    sub.add_parser("ls", help="one line per plan file, least recently used first")
    verify = sub.add_parser("verify", help="check every file (header, size, checksum); exit 1 if any is bad")
    verify.add_argument("--fix", action="store_true", help="remove the bad files")
    prune = sub.add_parser("prune", help="evict least recently used files down to a size")
    prune.add_argument("--max-bytes", help="target size, e.g. 2G (default: the configured cap)")
    sub.add_parser("clear", help="remove every plan file and the journal of seen keys")
    args = parser.parse_args(argv)

    if args.dir:
        plan_cache.configure(directory=args.dir)
    disk = plan_cache.disk
    entries = disk.entries()
    if args.command == "info":
        total = sum(size for _, size, _ in entries)
        print(f"directory  {disk.directory}")
        print(f"plans      {len(entries)} files, {_size(total)} (cap {_size(disk.max_bytes)})")
        print(f"mode       {plan_cache.policy.mode}")
        journal = plan_cache.admission
        print(f"seen keys  {journal.journal_keys()} in {journal.path.name} "
              f"({_size(journal.stats()['journal_bytes'])}); in mode auto a plan is written on "
              "its key's second sighting")
    elif args.command == "ls":
        now = time.time()
        for path, size, mtime in entries:
            print(f"{path.name[:16]}  {_size(size):>10}  {(now - mtime) / 60:7.1f} min ago  {_describe(path)}")
    elif args.command == "verify":
        bad, unfixed = 0, False
        for path, _, _ in entries:
            problem = verify_file(path)
            if problem is not None:
                bad += 1
                note = ""
                if args.fix:
                    try:
                        path.unlink(missing_ok=True)
                        note = "  (removed)"
                    except OSError as exc:  # e.g. another user's file in a shared directory
                        note, unfixed = f"  (not removed: {exc.strerror})", True
                print(f"BAD {path.name}: {problem}{note}")
        print(f"{len(entries) - bad} ok, {bad} bad")
        return 1 if bad and (not args.fix or unfixed) else 0
    elif args.command == "prune":
        cap = parse_bytes(args.max_bytes) if args.max_bytes else disk.max_bytes
        removed = disk.evict(cap)
        print(f"removed {len(removed)} files; {_size(disk.total_bytes())} left (cap {_size(cap)})")
    elif args.command == "clear":
        removed = disk.clear()
        plan_cache.admission.clear()
        print(f"removed {removed} files and the journal of seen keys from {disk.directory}")
    return 0
