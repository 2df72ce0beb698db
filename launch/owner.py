"""The detached owner of a cluster: ``python -m kvledger.launch.owner FILE`` runs the foreground ``up``.

``kvledger up --detach`` parses and validates every flag, pickles the
resulting ``UpOptions`` to ``FILE`` and starts this module in its own session;
it loads the options (removing the file) and holds the cluster exactly as
``kvledger up`` in the foreground would. A module of its own, so ``up.py`` is
never run as ``__main__`` (a second copy of its classes would then unpickle).
"""
from __future__ import annotations

import sys
from pathlib import Path

from kvledger.coordinator.ray_env import configure
from kvledger.launch.up import load_options, up


def main(argv: list[str]) -> int:
    configure()   # before up imports ray
    if len(argv) != 1:
        print("usage: python -m kvledger.launch.owner OPTIONS_FILE (written by `kvledger up --detach`)",
              file=sys.stderr)
        return 2
    return up(load_options(Path(argv[0])))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
