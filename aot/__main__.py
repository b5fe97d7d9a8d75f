"""`python -m aot` (and `make aot`): precompile the kernel variants flexplan dispatches for CUDA
and ROCm targets.

    python -m aot [--targets sm_90,gfx942] [--out aot_bundle] [--kernels wgrad] [--channels 32,64]
                  [--sample N] [--every K] [-j N] [--install] [--wheel [--wheel-dir DIR]]
                  [--no-compile-server]

Targets: those named, else this machine's GPUs (aot/targets.py), else every target flexplan
knows (DEFAULT_TARGETS). The variants: flexplan/aot/variants.py over the shapes of
flexplan/tuning/aot.py. Writes OUT/build.ninja (one edge per binary) and runs ninja on it:
parallel, incremental (a second run does nothing; touching a kernel source rebuilds its
binaries; another Triton version rebuilds all), with ninja's progress line; at the end it says
how many binaries, how many MB and how long. The edges hand their compiles to a warm compile
server (aot/compile_server.py: one process with Triton imported forks a child per binary), so
a binary costs its compile, not a fresh process's start-up. A variant this Triton cannot
compile is recorded as failed (the runtime leaves it to the JIT) instead of stopping the
build. OUT then holds a bundle: manifest.json plus <target>/<kernel>/<key>.{cubin,hsaco,json}.
--install copies the bundle into the user cache (flexplan.paths.aot_cache_dir()), where the
runtime finds it, and builds this machine's native launcher library there
(flexplan/launch_native.py: bundle-served processes load it instead of compiling); --wheel packs it as one installable wheel per target (aot/wheel.py), which
the runtime finds once pip-installed.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # the build compiles; it never interprets


def parse_args(argv):
    from aot.targets import DEFAULT_TARGETS
    from flexplan.aot.keys import TARGETS

    parser = argparse.ArgumentParser(prog="python -m aot", description=__doc__.split("\n\n")[0])
    parser.add_argument("--targets", default=None,
                        help="comma-separated targets (default: this machine's GPUs; without one "
                             f"{','.join(DEFAULT_TARGETS)})")
    parser.add_argument("--out", default="aot_bundle", help="bundle/build directory")
    parser.add_argument("--kernels", default=None, help="only kernels whose name contains this")
    parser.add_argument("--channels", default=None,
                        help="comma-separated layer widths to cover instead of the defaults (e.g. 32,64)")
    parser.add_argument("--sample", type=int, default=None,
                        help="only the first N variants of each kernel (quick checks, tests)")
    parser.add_argument("--every", type=int, default=None, metavar="K",
                        help="only every K-th variant of each target: a sample spread over every "
                             "kernel and config (timing a build)")
    parser.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--install", action="store_true",
                        help="copy the finished bundle into the user cache (flexplan.paths.aot_cache_dir())")
    parser.add_argument("--wheel", action="store_true",
                        help="pack the finished bundle as one wheel per target (pip install it)")
    parser.add_argument("--wheel-dir", default=None, help="where --wheel writes (default: OUT/dist)")
    parser.add_argument("--no-compile-server", action="store_true",
                        help="compile each binary in a fresh process of its own (slower; the "
                             "same binaries), instead of forks of one warm process")
    args = parser.parse_args(argv)
    args.origin = "--targets"
    if args.targets is None:
        from aot.targets import default_targets

        args.targets, args.origin = default_targets()
    else:
        args.targets = [t for t in args.targets.split(",") if t]
    args.channels = [int(c) for c in args.channels.split(",")] if args.channels else None
    if args.every is not None and args.every < 1:
        parser.error("--every takes a count of 1 or more")
    for t in args.targets:
        if t not in TARGETS:
            parser.error(f"unknown target {t!r}; choose from {', '.join(TARGETS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    from aot.report import failure_lines, manifest_of, summary_line

    start = time.monotonic()
    out = Path(args.out).resolve()
    ninja = shutil.which("ninja", path=_ninja_bin_dir())
    if ninja is None:
        print("aot: ninja not found (pip install ninja)", file=sys.stderr)
        return 1
    rc = _build(ninja, out, args)
    if rc != 0:
        return rc
    # Binaries of variants no longer listed (changed sources, other Triton) are removed.
    subprocess.call([ninja, "-C", str(out), "-t", "cleandead"], stdout=subprocess.DEVNULL)
    for line in failure_lines(manifest_of(out)):
        print(line)
    print(summary_line(out, time.monotonic() - start), flush=True)
    if args.install:
        from flexplan.aot.bundle import install_bundle

        print(f"aot: installed into {install_bundle(out)}")
        _build_native_launcher()
    if args.wheel:
        from aot.wheel import write_wheels

        dest = Path(args.wheel_dir).resolve() if args.wheel_dir else out / "dist"
        for path in write_wheels(out, dest, args.targets):
            print(f"aot: wheel {path} (pip install it; `python -m flexplan doctor` lists it)")
    return 0


def _build_native_launcher() -> None:
    """Build this machine's native launcher library (flexplan/launch_native.py) next to the
    installed bundle, so that bundle-served processes launch through it without compiling."""
    from flexplan import launch_native

    try:
        print(f"aot: native launcher {launch_native.build()}")
    except Exception as exc:  # no C compiler: bundle launches stay on aot.direct's path
        print(f"aot: native launcher not built ({type(exc).__name__}: {exc})")


def _build(ninja: str, out: Path, args) -> int:
    """Write build.ninja and run ninja on it, its edges served by a warm compile server."""
    from aot.compile_server import CompileServer
    from aot.ninja_file import edge_environment, write_build_file

    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **edge_environment(out)}
    server = None if args.no_compile_server else CompileServer(out, args.targets, env)
    try:  # the server warms up while the variants are enumerated
        count = write_build_file(out, args.targets, args.kernels, args.sample, args.channels, args.every)
        print(f"aot: {count} binaries for {','.join(args.targets)} ({args.origin}) in {out}", flush=True)
        ninja_env = server.ninja_env() if server else None
        return subprocess.call([ninja, "-C", str(out), "-j", str(args.jobs)], env=ninja_env)
    finally:
        if server:
            server.stop()


def _ninja_bin_dir() -> str:
    try:
        import ninja

        return os.pathsep.join([ninja.BIN_DIR, os.environ.get("PATH", "")])
    except ImportError:
        return os.environ.get("PATH", "")


if __name__ == "__main__":
    sys.exit(main())
