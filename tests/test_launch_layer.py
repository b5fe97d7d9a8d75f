"""The launch layer imports downward only (launcher -> aot.direct -> aot.runtime -> launch_abi),
yet the runtime's reset still reaches the caches above it, which register with it on import."""
from __future__ import annotations

import triton

from flexplan import launcher
from flexplan.aot import direct, launch_abi, runtime


def test_runtime_reset_clears_the_caches_of_the_layers_above():
    launcher._calls["resolved before the bundles changed"] = None
    direct._states[(0, 0)] = None
    direct._unavailable = "decided before the reset"
    runtime.reset()
    assert not launcher._calls and not direct._states
    assert direct._unavailable is direct._UNKNOWN


def test_the_direct_launch_asks_the_one_triton_version_gate(monkeypatch):
    monkeypatch.delenv(direct.LAUNCH_ENV, raising=False)
    monkeypatch.setattr(direct.torch.version, "hip", None)
    monkeypatch.setattr(direct, "_unavailable", direct._UNKNOWN)
    monkeypatch.setattr(launch_abi, "MIRRORED_VERSIONS", ("0.0.",))
    assert not launch_abi.mirrors_triton_launcher()
    assert direct.unavailable().startswith(f"Triton {triton.__version__}:")
    monkeypatch.setattr(launch_abi, "MIRRORED_VERSIONS", (triton.__version__,))
    assert launch_abi.mirrors_triton_launcher()
