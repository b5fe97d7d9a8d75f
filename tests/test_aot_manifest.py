"""A bundle's manifest is untrusted input: a malformed entry, or entry list, refuses the whole
bundle (the JIT compiles what no other bundle covers), and neither breaks the runtime's index
or the doctor."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from flexplan.aot import runtime
from flexplan.aot.bundle import read_bundle
from flexplan.aot.keys import MANIFEST_FORMAT, MANIFEST_NAME, triton_version

REPO = Path(__file__).resolve().parents[1]
GOOD = {"key": "k" * 64, "kernel": "conv_wgrad_kernel", "source_hash": "s", "file": "a.cubin",
        "sha256": "0", "metadata": "a.json", "metadata_sha256": "0"}


def _bundle(root: Path, entries) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / MANIFEST_NAME).write_text(json.dumps(
        {"format": MANIFEST_FORMAT, "triton_version": triton_version(), "entries": entries}))
    return root


def test_a_manifest_with_malformed_entries_is_refused_whole(tmp_path):
    root = _bundle(tmp_path / "b", [{"kernel": "x"}, GOOD, "entry", {**GOOD, "key": 3}, None])
    bundle = read_bundle(root)
    assert "4 of 5 entries fail the schema" in bundle.problem and bundle.entries == []
    assert read_bundle(_bundle(tmp_path / "ok", [GOOD])).entries == [GOOD]
    refused = read_bundle(_bundle(tmp_path / "c", "entries"))
    assert "'entries' is not a list" in refused.problem and refused.entries == []


def test_runtime_index_and_doctor_survive_malformed_manifests(tmp_path, monkeypatch):
    a = _bundle(tmp_path / "a", [{"kernel": "x"}, GOOD])
    b = _bundle(tmp_path / "b", "entries")
    good = _bundle(tmp_path / "good", [GOOD])
    monkeypatch.setenv("FLEXPLAN_AOT_PATH", f"{a}:{b}:{good}")
    runtime.reset()
    try:
        index = runtime.load_index()
        assert list(index) == [GOOD["key"]] and index[GOOD["key"]][0].root == good
        notes = runtime.refused_bundles()
        assert any("1 of 2 entries fail the schema" in n for n in notes)
        assert any("'entries' is not a list" in n for n in notes)
    finally:
        monkeypatch.delenv("FLEXPLAN_AOT_PATH")
        runtime.reset()
    env = {"FLEXPLAN_AOT_PATH": f"{a}:{b}", "FLEXPLAN_CACHE_DIR": str(tmp_path / "cache"),
           "PATH": "/usr/bin:/bin", "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-m", "flexplan", "doctor", "--target", "sm_90"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
