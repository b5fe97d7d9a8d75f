import atexit
import os
import shutil
import tempfile

import pytest
import torch

# Every run gets a cache root of its own (plans, their admission journal, AOT bundles, tuning
# tables), empty at the start: the suite neither reads what earlier runs, or other processes of
# this user, left in ~/.cache/flexplan (plan files loaded there are checked by a kernel, seconds
# each through the interpreter, and change which paths a test takes) nor writes there. Subprocesses
# inherit it. Tests that need another directory still set their own.
_CACHE_ROOT = tempfile.mkdtemp(prefix="flexplan-tests-")
os.environ["FLEXPLAN_CACHE_DIR"] = _CACHE_ROOT
# Removed at exit, after flexplan's own exit hook (atexit runs the later registered first) has
# flushed the journal of seen keys into it.
atexit.register(shutil.rmtree, _CACHE_ROOT, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        return
    skip = pytest.mark.skip(reason="needs a GPU (run scripts/gpu_check.sh on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device():
    """Where kernels run: the GPU when there is one, else the CPU through Triton's interpreter."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(autouse=True)
def _no_inverse_geometries_from_other_tests():
    """The planner's record of geometries an inverse conv asked a bwd map of
    (planner.generative.inverse_geometries) starts empty in every test: it decides what a
    graph-replayed inference build makes."""
    from flexplan.planner import generative

    generative.inverse_geometries.clear()
    yield
    generative.inverse_geometries.clear()
