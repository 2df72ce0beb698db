"""The state file of a cluster ``kvledger up`` started: where to reach it and which processes are ours.

``~/.kvledger/cluster.json`` by default (``KVLEDGER_HOME`` moves the folder).
``down`` stops exactly the processes recorded here and their descendants,
never every Ray on the machine.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path


def state_dir() -> Path:
    return Path(os.environ.get("KVLEDGER_HOME", Path.home() / ".kvledger"))


def state_path() -> Path:
    return state_dir() / "cluster.json"


def options_path() -> Path:
    """Where ``up --detach`` leaves the validated options for the owner it starts (which removes the file)."""
    return state_dir() / "up-options.pickle"


@dataclass
class ClusterState:
    address: str
    """Ray (GCS) address to join, ``host:port``."""
    namespace: str
    name_prefix: str
    num_ranks: int
    device: str
    block_counts: list[int] | None
    """Agreed (device, host) blocks per rank; ``None`` for a cluster of no ranks of its own."""
    owner_pid: int
    """The ``kvledger up`` process holding the cluster (foreground or detached)."""
    owner_start: int | None
    """Its start time (``start_time``), so a reused pid is never mistaken for it."""
    started_ray: bool
    """Whether ``up`` started this Ray (then ``down`` stops it) or joined one (``--address``)."""
    ray_pids: list[int] = field(default_factory=list)
    """Ray processes ``up`` started (head services), with their start times below."""
    ray_pid_starts: list[int] = field(default_factory=list)
    router_urls: list[str] = field(default_factory=list)
    """The HTTP API of each router replica ``up`` started (none: no router), the first replica's first."""
    router_names: list[str] = field(default_factory=list)
    """Names of the router actors (in ``namespace``), in the same order."""
    prefill_ranks: int = 0
    """The first this many ranks only prefill (``ClusterConfig.prefill_ranks``)."""
    ready: bool = False
    created: float = field(default_factory=time.time)

    @property
    def router_url(self) -> str | None:
        """The first replica's HTTP API (``None``: no router)."""
        return self.router_urls[0] if self.router_urls else None

    def save(self) -> Path:
        path = state_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2))
        tmp.replace(path)
        return path

    @classmethod
    def load(cls) -> ClusterState | None:
        path = state_path()
        if not path.exists():
            return None
        try:
            return cls(**json.loads(path.read_text()))
        except (ValueError, TypeError) as e:
            raise ValueError(f"{path} is not a kvledger state file ({e}); remove it by hand") from None

    @staticmethod
    def remove() -> None:
        state_path().unlink(missing_ok=True)


# ---------------------------------------------------------------------- processes, by pid only


def start_time(pid: int) -> int | None:
    """The kernel's start time of ``pid`` (clock ticks since boot), to tell a reused pid from ours."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def is_alive(pid: int, started: int | None = None) -> bool:
    st = start_time(pid)
    if st is None:
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z" and (started is None or st == started)


def _children() -> dict[int, list[int]]:
    """Parent pid -> the pids of its live children."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    return children


def descendants(pid: int, depth: int | None = None) -> list[tuple[int, int]]:
    """(pid, start time) of every live descendant of ``pid``, or of those at most ``depth`` generations down."""
    children = _children()
    out, stack = [], [(p, 1) for p in children.get(pid, [])]
    while stack:
        p, generation = stack.pop()
        st = start_time(p)
        if st is not None:
            out.append((p, st))
        if depth is None or generation < depth:
            stack.extend((c, generation + 1) for c in children.get(p, []))
    return out
