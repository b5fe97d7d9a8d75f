"""The library versions flexplan's files are bound to, asked in one place: bundles and their
binaries (flexplan.aot.keys), tuned tables (flexplan.tuning.device) and the launch layer's gate
(flexplan.aot.launch_abi) all read the Triton version here. Imports nothing from flexplan."""
from __future__ import annotations


def triton_version() -> str:
    import triton

    return triton.__version__
