"""`python -m flexplan <command> ...`: each command lives in the module that owns the concept."""
from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "cache": ("flexplan.cache.cli", "inspect and maintain the plan cache"),
    "doctor": ("flexplan.aot.doctor", "device, Triton version, matching AOT bundles"),
    "tune": ("flexplan.tuning.cli", "autotune kernel configs for this GPU"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        print("usage: python -m flexplan {" + ",".join(COMMANDS) + "} ...")
        for name, (_, about) in COMMANDS.items():
            print(f"  {name:8s} {about}")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    module = importlib.import_module(COMMANDS[argv[0]][0])
    return int(module.main(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
