"""Pick the kernel config of one call: the tuned table's entry for its bucket, else (opted in
with FLEXPLAN_TUNE) tune that bucket, else the entry of its nearest tuned rows bucket of the same
shape (neighbour_config), else the heuristic default at once.

FLEXPLAN_TUNE: "off" (default): never benchmark at run time.
               "background": tune missing buckets in a worker thread; calls use the
                             neighbour's config or the heuristic until the result lands
                             (timings share the GPU with the caller).
               "ondemand":   tune a missing bucket in the call that first needs it (one-off
                             pause of seconds, exact timings).
Tables are read once per device and process; a call seen before is one dict get, a new one a
bucket computation plus a dict get (a new bucket once: the table's entry, its nearest tuned
neighbour through an index of the table by shape, or the heuristic's few arithmetic steps).

Selection sits below the ops (they call select_config); run-time tuning sits above them (it
times the ops' launches, cases.py). So this module never imports the tuner: a missing bucket
goes to the hook set with set_tuning_hook, which flexplan/tuning/__init__.py installs (Python
runs it before any module of the package, so the hook is there whenever dispatch is).
"""
from __future__ import annotations

import os
import threading
import warnings
from dataclasses import replace
from typing import Callable

from ..kernel_configs import KernelConfig, Problem, heuristic_config, splitk_workspace_fits
from ..thread_setting import ThreadSetting
from . import table as _table
from .buckets import Bucket
from .device import DeviceKey, current_device_index, device_key

TUNE_ENV = "FLEXPLAN_TUNE"
TUNE_MODES = ("off", "background", "ondemand")

_forced = ThreadSetting(None)
_lock = threading.RLock()
_tables: dict = {}   # device index -> {Bucket: KernelConfig}, this GPU's merged tables
_memo: dict = {}     # (device index, Bucket) -> KernelConfig, or _HEURISTIC
_HEURISTIC = object()
# The answer per exact call (a layer asks with the same problem every step), skipping the
# bucket computation; forgotten whenever answers may change (add_configs, reset).
_answers: dict = {}  # (family, Problem, device index) -> KernelConfig
_MAX_ANSWERS = 4096
_generation = 0
_warned: set = set()  # one warning per unusable table file
# fn(device index, bucket, mode) -> KernelConfig now, or None (heuristic meanwhile); None: no
# run-time tuner installed.
TuningHook = Callable[[int, Bucket, str], KernelConfig | None]
_tuning_hook: TuningHook | None = None


def forced_config(config: KernelConfig):
    """A with block within which (this thread only) select_config returns `config`: how the
    tuner measures a config through the ops' own launch code."""
    return _forced.set(config)


def select_config(family: str, problem: Problem) -> KernelConfig:
    forced = _forced.get()
    if forced is not None:
        return forced
    key = (family, problem, current_device_index())
    config = _answers.get(key)
    if config is None:
        generation = _generation
        config = _config_for(*key)
        with _lock:
            if generation == _generation:  # not computed from tables changed meanwhile
                if len(_answers) >= _MAX_ANSWERS:
                    _answers.clear()
                _answers[key] = config
    return config


def answers_epoch() -> int | None:
    """A number that changes whenever select_config's answers may (tables loaded, tuned or
    reset), or None while this thread forces a config: a caller may keep an answer under the
    epoch it was given in, and must not keep one given under None."""
    return None if _forced.get() is not None else _generation


def config_from(configs: dict, family: str, problem: Problem,
                shared_memory: int | None = None) -> KernelConfig:
    """The rule select_config applies with a device's tables `configs` ({Bucket: KernelConfig}):
    the problem's bucket's tuned config, else its nearest tuned neighbour's (neighbour_config),
    else the heuristic on the exact problem (on a GPU with shared_memory bytes per program;
    default: this one). The AOT build enumerates it per target (flexplan/tuning/aot.py)."""
    bucket = Bucket.of(problem)
    config = configs.get(bucket)
    if config is None:
        config = neighbour_config(configs, bucket)
    return config if config is not None else heuristic_config(family, problem, shared_memory)


def neighbour_config(configs: dict, bucket: Bucket) -> KernelConfig | None:
    """For a bucket the table misses: the tuned config of the nearest bucket of the same shape
    (part, algorithm, dtype, volume, channels; at equal distance in powers of two, the one of
    more rows), if the table has one (else None: the heuristic). A layer whose rows (pairs, for
    grad-weight) straddle a bucket boundary from step to step then keeps the tuned config on
    both sides, where the heuristic on the untuned side would hand it a second binary to
    compile mid-job under the JIT (a float32 U-Net's grad-weight and an inverse conv's
    grad-input on the H200's table did: scripts/probe_dispatch_classes.py,
    scripts/results/bench_precision.md, session 46). A tuned config serves a problem of other
    rows than its bucket's: block sizes and splits only set how the work is cut; one whose
    split-K partials would pass SPLITK_WORKSPACE_BYTES at this bucket's rows is not taken (its
    own bucket's tuning kept it within them), the next nearest is. (Layers still change binary
    where their rows cross choose_algo's algorithm boundary, another shape, or the midpoint
    between two tuned buckets of one shape.)"""
    rows_tuned = _shape_index(configs).get(bucket.shape)
    if not rows_tuned:
        return None
    largest = bucket.representative()
    here = bucket.n.bit_length()
    for rows in sorted(rows_tuned, key=lambda n: (abs(n.bit_length() - here), -n)):
        config = configs[replace(bucket, n=rows)]
        if config.splitk == 1 or splitk_workspace_fits(largest, config.splitk):
            return config
    return None


# id(configs) -> (configs, its size when indexed, {shape: rows buckets}): the AOT build asks
# config_from about one table a million times; the run-time table grows by add_configs (its
# size then differs: indexed again). The table itself is held, so its id stays its own.
_shape_indexes: dict = {}


def _shape_index(configs: dict) -> dict:
    known = _shape_indexes.get(id(configs))
    if known is not None and known[0] is configs and known[1] == len(configs):
        return known[2]
    index: dict = {}
    for tuned in list(configs):
        index.setdefault(tuned.shape, []).append(tuned.n)
    with _lock:
        if len(_shape_indexes) >= 16:
            _shape_indexes.clear()
        _shape_indexes[id(configs)] = (configs, len(configs), index)
    return index


def _config_for(family: str, problem: Problem, index) -> KernelConfig:
    bucket = Bucket.of(problem)
    config = _memo.get((index, bucket))
    if config is None:
        config = _resolve(index, bucket)
    # A miss runs the heuristic on the call's own problem (a few microseconds): its block
    # sizes depend only on the bucket, its split count on the exact sizes.
    return heuristic_config(family, problem) if config is _HEURISTIC else config


def _resolve(index, bucket: Bucket):
    with _lock:
        table = _table_for(index)
        config = table.get(bucket)
        if config is None and index is not None:
            config = _tune_missing(index, bucket)
        if config is None:
            config = neighbour_config(table, bucket)
        _memo[(index, bucket)] = config = config or _HEURISTIC
    return config


def set_tuning_hook(hook: TuningHook | None) -> TuningHook | None:
    """Install the run-time tuner asked for buckets the tables miss while FLEXPLAN_TUNE is not
    "off" (mode "ondemand" or "background"); returns the previous hook."""
    global _tuning_hook
    previous, _tuning_hook = _tuning_hook, hook
    return previous


def _tune_missing(index: int, bucket: Bucket) -> KernelConfig | None:
    mode = tune_mode()
    if mode == "off" or _tuning_hook is None:
        return None
    return _tuning_hook(index, bucket, mode)


def tune_mode() -> str:
    mode = os.environ.get(TUNE_ENV, "off").strip().lower() or "off"
    if mode not in TUNE_MODES:
        _warn_once(TUNE_ENV, f"{TUNE_ENV}={mode!r} is not one of {TUNE_MODES}; tuning stays off")
        return "off"
    return mode


def add_configs(index: int, configs: dict) -> None:
    """Make freshly tuned {Bucket: KernelConfig} visible to the next calls."""
    with _lock:
        _table_for(index).update(configs)
        # (and every bucket of their shapes, which may have borrowed another's config)
        shapes = {bucket.shape for bucket in configs}
        for key in [key for key in _memo if key[0] == index and key[1].shape in shapes]:
            del _memo[key]
        _forget_answers()


def _forget_answers() -> None:
    global _generation
    with _lock:
        _answers.clear()
        _generation += 1


def reset() -> None:
    """Forget loaded tables, memoized configs and warnings (tests; after writing a table)."""
    with _lock:
        _tables.clear()
        _memo.clear()
        _forget_answers()
        _warned.clear()


def _table_for(index) -> dict:
    if index not in _tables:
        _tables[index] = {} if index is None else load_configs(device_key(index))
    return _tables[index]


def load_configs(device: DeviceKey) -> dict:
    """{Bucket: KernelConfig} for `device`: the shipped table, overridden by the user's."""
    configs = {}
    for path in _table.shipped_table_paths():
        table = _read_or_warn(path)
        if table is None or not table.device.same_gpu(device):
            continue  # a table for another GPU: not ours, nothing to say
        if table.device != device:
            _warn_once(path, f"flexplan: shipped tuning table {path.name} was tuned with Triton "
                             f"{table.device.triton}, this is Triton {device.triton}; using "
                             "heuristic configs (run `python -m flexplan tune` to tune this GPU)")
            continue
        configs.update({b: e.config for b, e in table.entries.items()})
    path = _table.user_table_path(device)
    if path.exists():
        table = _read_or_warn(path)
        if table is not None and table.device != device:
            _warn_once(path, f"flexplan: tuning table {path} belongs to {table.device}, not to "
                             f"{device}; ignored")
        elif table is not None:
            configs.update({b: e.config for b, e in table.entries.items()})
    return configs


def _read_or_warn(path):
    try:
        return _table.read_table(path)
    except _table.TableError as err:
        _warn_once(path, f"flexplan: ignoring unusable tuning table {path}: {err}")
        return None


def _warn_once(key, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=4)
