"""Pick the kernel config for one problem: a tuned table entry if any, else the heuristic."""
from __future__ import annotations


def select_config(family: str, problem):
    from ..kernel_configs import heuristic_config

    return heuristic_config(family, problem)
