"""Autotuned kernel configs, persisted per GPU.

select_config(family, problem) is what ops call to pick a kernel config: the tuned table's
entry for the problem's bucket (buckets.py; tables: table.py, shipped ones in tables/), else the
heuristic default from flexplan.kernel_configs (dispatch.py; run-time tuning: online.py).
`python -m flexplan tune` (cli.py) measures configs (tuner.py) on sphere shells (cases.py).
aot.py defines what the AOT build covers: the layer shapes and the conv launches dispatch makes
for them (conv_launches); configs_for_aot() lists every config dispatch can return.

Two directions in one package: selection (dispatch, table, buckets, device, aot) sits below the
ops and never imports them or the tuner; tuning (tuner, cases, online, cli) sits above them,
since it times their launches. This file wires the two (below), so it is the top of the package:
the ops import select_config from flexplan.tuning.dispatch, not from here.
"""
from . import dispatch, online
from .aot import configs_for_aot
from .dispatch import forced_config, select_config

# Run-time tuning plugs into dispatch here rather than dispatch importing it. Python runs this
# file before any module of the package, so every process that can reach select_config has the
# hook, and FLEXPLAN_TUNE (read by dispatch on each table miss) works as before, set before or
# after import. online imports its heavy parts (cases -> ops, planner) only when it tunes.
dispatch.set_tuning_hook(online.tune_missing)

__all__ = ["configs_for_aot", "forced_config", "select_config"]
