"""The AOT build's compile server (aot/compile_server.py): a build whose edges it serves writes the
same bytes as one process per binary; a served edge imports no Triton; an edge it does not serve
(another environment, no server) compiles in its own process, to the same bytes. One small
kernel (sm_90 plan_bounds), so a few seconds per build; without TRITON_INTERPRET (the build
compiles)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # the build package aot/ lives at the repository's root
    sys.path.insert(0, str(REPO))

from aot.compile_server import SERVER_ENV, CompileServer  # noqa: E402
from aot.ninja_file import edge_environment  # noqa: E402

BUILD = ["--targets", "sm_90", "--kernels", "plan_bounds", "--sample", "1", "-j", "1"]
SKIPPED = {".triton-cache", ".ninja_log", ".ninja_deps", "build.ninja"}  # caches; paths of OUT


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(REPO)
    env.update(extra)
    return env


def _build(out: Path, *flags: str) -> str:
    cmd = [sys.executable, "-m", "aot", *BUILD, "--out", str(out), *flags]
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-3000:]
    assert "compiling here" not in log and "did not start" not in log, log[-3000:]
    return log


def _files(out: Path) -> dict:
    return {str(p.relative_to(out)): p.read_bytes() for p in out.rglob("*")
            if p.is_file() and p.relative_to(out).parts[0] not in SKIPPED}


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    root = tmp_path_factory.mktemp("aot-speed")
    _build(root / "cold", "--no-compile-server")
    _build(root / "served")
    return root / "cold", root / "served"


def test_served_build_writes_the_bytes_of_one_process_per_binary(builds):
    cold, served = builds
    files = _files(cold)
    assert any(name.endswith(".cubin") for name in files) and "manifest.json" in files
    assert _files(served) == files


def _run_edge(out: Path, env: dict) -> subprocess.CompletedProcess:
    """The edge's command, as ninja runs it in OUT, after removing its outputs; prints whether
    the edge process imported Triton."""
    entry = next(out.glob("sm_90/*/*.entry.json"))
    stem = str(entry).removesuffix(".entry.json")
    for suffix in (".entry.json", ".cubin", ".json"):
        Path(stem + suffix).unlink()
    spec = out / "specs" / (Path(stem).name + ".json")
    code = ("import sys; from aot.compile_one import main; "
            f"main([{str(spec)!r}, {str(entry.relative_to(out))!r}, '--triton-version', 'v', "
            "'--source-hash', 'h']); print('triton imported:', 'triton' in sys.modules)")
    return subprocess.run([sys.executable, "-c", code], cwd=out, env=env, capture_output=True,
                          text=True, timeout=300)


def test_edges_are_served_without_triton_or_compile_themselves(builds, tmp_path):
    cold, _ = builds
    expected = _files(cold)
    env = _env(**edge_environment(cold))
    server = CompileServer(cold, ["sm_90"], env)
    try:
        ninja_env = server.ninja_env()
        assert ninja_env is not None and ninja_env[SERVER_ENV] == server.path
        served = _run_edge(cold, ninja_env)
        assert served.returncode == 0 and "triton imported: False" in served.stdout, served.stderr
        assert _files(cold) == expected
        # Another environment than the server's: the edge compiles itself, to the same bytes.
        other = _run_edge(cold, {**ninja_env, "FLEXPLAN_TEST_OTHER": "1"})
        assert "environment differs (FLEXPLAN_TEST_OTHER" in other.stderr, other.stderr
        assert other.returncode == 0 and "triton imported: True" in other.stdout
        assert _files(cold) == expected
    finally:
        server.stop()
    # No server there any more: compiled in the edge's process, silently.
    gone = _run_edge(cold, ninja_env)
    assert gone.returncode == 0 and "triton imported: True" in gone.stdout and not gone.stderr.strip()
    assert _files(cold) == expected
