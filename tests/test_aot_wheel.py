"""`python -m aot --wheel` (aot/wheel.py): a bundle packed as one wheel per target, pip-installed
into a fresh virtualenv, is found by the runtime (through its entry point) and listed by the
doctor, which still refuses another Triton's binaries and says when a bundle serves other
targets. Fake binaries (packing and finding do not look inside them): no compile, a few seconds."""
from __future__ import annotations

import base64
import hashlib
import json
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # the build package aot/ lives at the repository's root
    sys.path.insert(0, str(REPO))

from aot.wheel import package_name, write_wheel, write_wheels  # noqa: E402
from flexplan.aot.keys import MANIFEST_FORMAT, triton_version  # noqa: E402


def _fake_bundle(root: Path, targets, version: str | None = None) -> Path:
    """A bundle as `python -m aot` leaves it: manifest.json and, per target, one binary and its
    metadata (fake bytes, true digests)."""
    entries = []
    for target in targets:
        ext = "hsaco" if target.startswith("gfx") else "cubin"
        stem = f"{target}/conv_wgrad/{target}key"
        (root / target / "conv_wgrad").mkdir(parents=True, exist_ok=True)
        blob, meta = f"binary for {target}".encode(), b'{"name": "conv_wgrad_kernel"}'
        (root / f"{stem}.{ext}").write_bytes(blob)
        (root / f"{stem}.json").write_bytes(meta)
        entries.append({"key": f"{target}key", "kernel": "flexplan.kernels_src.conv_wgrad.conv_wgrad_kernel",
                        "target": target, "triton_version": version or triton_version(),
                        "source_hash": "s", "file": f"{stem}.{ext}",
                        "sha256": hashlib.sha256(blob).hexdigest(), "metadata": f"{stem}.json",
                        "metadata_sha256": hashlib.sha256(meta).hexdigest()})
    (root / "manifest.json").write_text(json.dumps({
        "format": MANIFEST_FORMAT, "triton_version": version or triton_version(),
        "targets": sorted(targets), "entries": entries, "failed": []}))
    return root


def test_the_wheel_holds_the_targets_bundle_and_a_valid_record(tmp_path):
    bundle = _fake_bundle(tmp_path / "bundle", ["sm_90", "gfx942"])
    path = write_wheel(bundle, "sm_90", tmp_path / "dist")
    assert path.name.startswith(f"flexplan_kernels_sm90-") and path.name.endswith("-py3-none-any.whl")
    assert f"+triton{triton_version()}." in path.name
    with zipfile.ZipFile(path) as whl:
        names = whl.namelist()
        info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/RECORD"))
        manifest = json.loads(whl.read("flexplan_kernels_sm90/manifest.json"))
        assert manifest["targets"] == ["sm_90"] and [e["target"] for e in manifest["entries"]] == ["sm_90"]
        assert "flexplan_kernels_sm90/sm_90/conv_wgrad/sm_90key.cubin" in names
        assert not any("gfx942" in n for n in names)
        assert "Name: flexplan-kernels-sm90\n" in whl.read(f"{info}/METADATA").decode()
        assert "Root-Is-Purelib: true" in whl.read(f"{info}/WHEEL").decode()
        assert whl.read(f"{info}/entry_points.txt").decode() == (
            "[flexplan.aot_bundles]\nsm_90 = flexplan_kernels_sm90\n")
        record = whl.read(f"{info}/RECORD").decode().splitlines()
        assert sorted(line.split(",")[0] for line in record) == sorted(names)
        for line in record:
            name, digest, size = line.split(",")
            if name.endswith("RECORD"):
                continue
            data = whl.read(name)
            assert digest == "sha256=" + base64.urlsafe_b64encode(
                hashlib.sha256(data).digest()).rstrip(b"=").decode() and int(size) == len(data)
    # The same bundle packs to the same bytes.
    again = write_wheel(bundle, "sm_90", tmp_path / "again")
    assert again.read_bytes() == path.read_bytes()
    assert package_name("gfx942") == "flexplan_kernels_gfx942"


@pytest.fixture(scope="module")
def venv_with_wheels(tmp_path_factory):
    """A fresh virtualenv (this environment's packages visible, as --system-site-packages makes
    a venv see its base's) with three bundle wheels pip-installed: sm_90 and gfx942 of this
    Triton, sm_80 of another."""
    work = tmp_path_factory.mktemp("wheels")
    dist = work / "dist"
    write_wheels(_fake_bundle(work / "current", ["sm_90", "gfx942"]), dist)
    write_wheels(_fake_bundle(work / "old", ["sm_80"], version="0.0.1"), dist)
    venv = work / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip",
                    str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    where = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    purelib = Path(subprocess.run([str(python), "-c", where], check=True, capture_output=True,
                                  text=True).stdout.strip())
    ours = [p for p in sys.path if p.endswith(("site-packages", "dist-packages"))]
    (purelib / "_parent_env.pth").write_text(f"import site; list(map(site.addsitedir, {ours!r}))\n")
    proc = subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                           *map(str, sorted(dist.glob("*.whl")))], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return python, purelib


_FIND = r'''
import json, sys
sys.path.insert(0, sys.argv[1])
import flexplan.aot.bundle  # noqa: F401 (the runtime's bundle search, without torch:)
assert "torch" not in sys.modules
from flexplan.aot.bundle import bundle_dirs, read_bundle
print(json.dumps([[str(d), read_bundle(d).problem, len(read_bundle(d).entries)] for d in bundle_dirs()]))
'''


def test_installed_wheels_are_found_by_the_runtime(venv_with_wheels, tmp_path):
    python, purelib = venv_with_wheels
    env = {"FLEXPLAN_CACHE_DIR": str(tmp_path / "cache"), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([str(python), "-c", _FIND, str(REPO)], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = {Path(d).name: (problem, n) for d, problem, n in json.loads(proc.stdout.splitlines()[-1])}
    assert found["flexplan_kernels_sm90"] == (None, 1)
    assert found["flexplan_kernels_gfx942"] == (None, 1)
    problem, count = found["flexplan_kernels_sm80"]
    assert "built with Triton 0.0.1" in problem and count == 0  # refused whole
    assert all(Path(d).parent == purelib for d, *_ in json.loads(proc.stdout.splitlines()[-1]))


def test_the_doctor_lists_installed_bundles_and_what_they_serve(venv_with_wheels, tmp_path,
                                                                monkeypatch, capsys):
    from flexplan.aot import doctor, runtime

    _, purelib = venv_with_wheels
    monkeypatch.setenv("FLEXPLAN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("FLEXPLAN_AOT_PATH", raising=False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.syspath_prepend(str(purelib))
    try:
        assert doctor.main(["--target", "sm_90"]) == 0
    finally:
        runtime.reset()
    lines = {Path(line.split()[1]).name: line for line in capsys.readouterr().out.splitlines()
             if line.startswith("bundle:  ")}
    assert lines["flexplan_kernels_sm90"].endswith("1 binaries for sm_90  usable")
    assert "usable, but none for this target sm_90" in lines["flexplan_kernels_gfx942"]
    assert f"refused (Triton 0.0.1; this is Triton {triton_version()}" in lines["flexplan_kernels_sm80"]
    assert sysconfig.get_paths()["purelib"] != str(purelib)  # (the test's own env is untouched)
