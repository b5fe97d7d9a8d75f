"""Autotuned kernel configs, persisted per GPU.

select_config(family, problem) is what ops call to pick a kernel config: the tuned table's
entry for the problem's bucket (buckets.py; tables: table.py, shipped ones in tables/), else the
heuristic default from flexplan.kernel_configs (dispatch.py; run-time tuning: online.py).
`python -m flexplan tune` (cli.py) measures configs (tuner.py) on sphere shells (cases.py).
configs_for_aot() lists every config dispatch can return, for the AOT build (aot.py).
"""
from .aot import configs_for_aot
from .dispatch import forced_config, select_config

__all__ = ["configs_for_aot", "forced_config", "select_config"]
