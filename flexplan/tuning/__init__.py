"""Autotuned kernel configs, persisted per GPU.

select_config(family, problem) is what ops call to pick a kernel config; until a tuned table
exists for this GPU it returns the heuristic default from flexplan.kernel_configs.
"""
from .dispatch import select_config

__all__ = ["select_config"]
