"""A per-thread setting changed for the length of a with block: what the tuner forces on
dispatch (tuning/dispatch.forced_config), a graph capture's first-use pass (planner/
graph_registry.FIRST_USE_PASS). Other threads keep the default."""
from __future__ import annotations

import contextlib
import threading


class ThreadSetting:
    """A value per thread, `default` where no with block of this thread set it."""

    def __init__(self, default=None):
        self._local = threading.local()
        self._default = default

    def get(self):
        return getattr(self._local, "value", self._default)

    @contextlib.contextmanager
    def set(self, value):
        """Within the block (this thread only), get() returns value."""
        before = self.get()
        self._local.value = value
        try:
            yield
        finally:
            self._local.value = before
