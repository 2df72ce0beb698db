"""The command line against real processes: ``up --workload bundled``, ``up --detach`` / ``status`` / ``down``."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from processes import run

from kvledger.launch.cli import main
from kvledger.launch.state import ClusterState, descendants, is_alive, start_time

ROOT = Path(__file__).parents[2]


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("KVLEDGER_HOME", str(tmp_path))
    return tmp_path


def kvledger(home: Path, *args: str, timeout: float = 200) -> subprocess.CompletedProcess:
    """``kvledger ARGS`` in a child process of its own session (on a timeout its whole group is killed)."""
    env = {**os.environ, "KVLEDGER_HOME": str(home), "PYTHONPATH": str(ROOT)}
    return run([sys.executable, "-m", "kvledger.launch.cli", *args], timeout=timeout, env=env, cwd=ROOT)


@dataclass
class Detached:
    """What a test learned of the cluster it detached: the processes teardown checks are gone."""

    states: list[ClusterState] = field(default_factory=list)
    processes: set[tuple[int, int]] = field(default_factory=set)
    """(pid, start time) of the owner, its descendants and the Ray processes it started."""

    def saw(self, state: ClusterState | None) -> None:
        if state is None:
            return
        self.states.append(state)
        if state.owner_start is not None:
            self.processes.add((state.owner_pid, state.owner_start))
        if is_alive(state.owner_pid, state.owner_start):
            self.processes.update(descendants(state.owner_pid))
        self.processes.update((p, s) for p, s in zip(state.ray_pids, state.ray_pid_starts) if s is not None)

    def alive(self) -> list[int]:
        return sorted(p for p, s in self.processes if is_alive(p, s))


def owners_of(home: Path) -> list[int]:
    """Live ``kvledger.launch.owner`` processes of this ``KVLEDGER_HOME`` (their handoff file lies in it)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"kvledger.launch.owner" in argv and any(a.startswith(str(home).encode()) for a in argv) \
                and is_alive(int(entry.name)):
            found.append(int(entry.name))
    return found


@pytest.fixture
def detached(home):
    """Teardown for a test that runs ``up --detach``: from the moment the cluster may exist, ``kvledger down``
    runs at the end whatever the test did (an assertion failing right after ``up`` included), and nothing of
    the cluster may be left running.

    The test reports what it learns (``detached.saw(state)``) and runs its own ``down`` as part of what it
    checks; teardown runs ``down`` again only when a state file is still there. An owner that never wrote a
    state file is found by its command line (its handoff file lies in ``KVLEDGER_HOME``) and killed with its
    process group (it leads a session, and the Ray it started stays in its group).
    """
    seen = Detached()
    yield seen
    problems = []
    if (home / "cluster.json").exists():
        try:
            seen.saw(ClusterState.load())
        except ValueError as e:   # down reports the same file; it still stops what it can
            problems.append(str(e))
        dn = kvledger(home, "down", timeout=120)
        if dn.returncode != 0:
            problems.append(f"`kvledger down` at teardown exited {dn.returncode}: {dn.stdout}{dn.stderr}")
    for pid in owners_of(home):   # escaped the state file: stop it and all it started
        seen.processes.add((pid, start_time(pid) or 0))
        seen.processes.update(descendants(pid))
        problems.append(f"owner pid {pid} was still running without a state file")
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    left = seen.alive()
    for pid in left:   # ours (checked by start time): do not leave them for the next test
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if left:
        problems.append(f"processes of the detached cluster still alive after down: {left}")
    if (home / "cluster.json").exists():
        problems.append("the state file survived `kvledger down`")
    assert not problems, "\n".join(problems)


def refused(capsys, *argv: str) -> str:
    """``kvledger ARGV`` is refused by argparse (exit 2); its message."""
    with pytest.raises(SystemExit) as e:
        main(list(argv))
    assert e.value.code == 2
    return capsys.readouterr().err


def test_bad_arguments_and_no_cluster_are_clear_errors(home, capsys):
    assert "argument --ranks: ClusterConfig.num_ranks must be an int >= 0" in refused(capsys, "up", "--ranks", "-1")
    assert "--ranks 0 starts no rank of its own: give the router vLLM servers (--vllm URL)" in refused(
        capsys, "up", "--ranks", "0")
    assert "argument --vllm: vllm servers are http://HOST:PORT, got 'localhost:8000'" in refused(
        capsys, "up", "--ranks", "0", "--vllm", "localhost:8000")
    assert "cannot be combined with --detach" in refused(capsys, "up", "--detach", "--workload", "bundled")
    assert "argument --port: port must be in 0..65535" in refused(capsys, "up", "--port", "70000")
    assert "argument --policy: invalid choice 'fastest'" in refused(capsys, "up", "--policy", "fastest")
    assert "argument --device: invalid choice: 'tpu'" in refused(capsys, "up", "--device", "tpu")
    assert not list(home.iterdir()), "a refused `up` leaves nothing behind"
    assert main(["status"]) == 1 and "no kvledger cluster is up" in capsys.readouterr().out
    assert main(["down"]) == 1


def test_up_runs_the_bundled_workload_and_stops(home):
    proc = kvledger(home, "up", "--ranks", "2", "--device", "cpu", "--workload", "bundled")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "agreed block counts" in out and "migrated" in out and "cluster stopped" in out
    rows = [ln.split() for ln in out.splitlines() if ln[:3].strip().isdigit()]
    assert len(rows) == 7 and {r[1] for r in rows} == {"0", "1"}, out
    assert int(rows[1][2]) > 0, "the second prompt reuses the shared system prompt"
    assert not (home / "cluster.json").exists()


def driver_refused(address: str, home: Path, **env: str) -> str:
    """A Ray driver joining ``address`` with ``env`` (and ``home`` as its ``HOME``, so no token file of ours) is
    refused: what it printed."""
    clean = {k: v for k, v in os.environ.items() if k not in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")}
    code = f"import ray; ray.init(address={address!r}, logging_level=40); print('JOINED')"
    proc = run([sys.executable, "-c", code], timeout=120, env={**clean, "HOME": str(home), **env}, cwd=home)
    assert proc.returncode != 0 and "JOINED" not in proc.stdout, proc.stdout + proc.stderr
    return proc.stderr


def test_detached_cluster_status_and_down_leave_no_process(home, detached):
    # from here on the cluster may exist: the `detached` fixture runs `kvledger down` whatever happens below
    proc = kvledger(home, "up", "--ranks", "2", "--device", "cpu", "--detach", "--port", "0", "--policy", "kv",
                    "--routers", "2")
    state = ClusterState.load()
    detached.saw(state)
    log = home / "up.log"
    assert proc.returncode == 0, proc.stdout + proc.stderr + (log.read_text() if log.exists() else "")
    assert state is not None and state.ready and state.started_ray and state.address.startswith("127.0.0.1:")
    assert is_alive(state.owner_pid, state.owner_start)
    tree = descendants(state.owner_pid)  # Ray's services and the rank actors' worker processes
    detached.processes.update(tree)
    assert len(tree) >= len(state.ray_pids) + 2
    again = kvledger(home, "up", "--detach")
    assert again.returncode == 1 and "already up" in again.stdout
    st = kvledger(home, "status", "--json", timeout=120)
    assert st.returncode == 0, st.stdout + st.stderr
    report = json.loads(st.stdout)
    assert report["num_ranks"] == 2 and report["device"] == "cpu"
    assert [r["alive"] for r in report["ranks"]] == [True, True]
    assert {(r["device_blocks"], r["host_blocks"]) for r in report["ranks"]} == {tuple(state.block_counts)}
    assert [(r["index"], r["url"], r["state"]) for r in report["routers"]] == [
        (i, url, "ready") for i, url in enumerate(state.router_urls)]
    text = kvledger(home, "status", timeout=120)
    assert text.returncode == 0 and "2 router(s)" in text.stdout, text.stdout
    for i, url in enumerate(state.router_urls):
        assert f"router {i}: {url} ready" in text.stdout
    # the routers the state file names, through real processes and real HTTP: replicas on ports of their own
    assert len(set(state.router_urls)) == 2 and all(u.startswith("http://127.0.0.1:") for u in state.router_urls)
    prompt = "You are a terse assistant. Answer with one word only, please. Q: "
    first = kvledger(home, "route", prompt + "sky?", "--max-tokens", "2", timeout=120)
    second = kvledger(home, "route", prompt + "grass?", "--max-tokens", "2", "--router-index", "1", timeout=120)
    assert first.returncode == 0 and second.returncode == 0, first.stdout + second.stdout
    assert "cached 0" in first.stdout and "output:" in first.stdout
    assert first.stdout.split()[1] == second.stdout.split()[1], "replica 1 saw replica 0's blocks: same rank"
    predicted, cached = (int(n) for n in re.search(r"predicted cached (\d+)  cached (\d+)", second.stdout).groups())
    assert predicted >= 64 and cached >= 64, second.stdout
    nowhere = kvledger(home, "route", prompt, "--router-index", "2", timeout=60)
    assert nowhere.returncode == 2 and "the running cluster has 2 router(s), 0..1" in nowhere.stdout
    # Ray's token authentication is on: a driver without the token, or with another, is refused
    assert "no authentication token was found" in driver_refused(state.address, home)
    assert "token is missing or incorrect" in driver_refused(state.address, home, RAY_AUTH_TOKEN="0" * 64)
    mon = kvledger(home, "monitor", "--json", "--seconds", "1", timeout=60)
    assert mon.returncode == 0 and '"type":"BlockStored"' in mon.stdout, mon.stdout + mon.stderr
    # down itself, as checked behaviour (teardown repeats it only if this did not get as far)
    dn = kvledger(home, "down", timeout=120)
    assert dn.returncode == 0, dn.stdout + dn.stderr
    assert not is_alive(state.owner_pid, state.owner_start)
    assert not [p for p, s in zip(state.ray_pids, state.ray_pid_starts) if is_alive(p, s)]
    assert not [p for p, s in tree if is_alive(p, s)], "down leaves no process of the cluster running"
    assert not (home / "cluster.json").exists()


def test_a_stale_state_file_is_reported_and_cleaned_up(home, capsys):
    ClusterState(address="127.0.0.1:1", namespace="kvledger", name_prefix="kvledger-rank", num_ranks=2,
                 device="cpu", block_counts=[8, 0], owner_pid=2 ** 22 + 1, owner_start=None, started_ray=True).save()
    assert main(["status"]) == 1 and "does not answer" in capsys.readouterr().out
    assert main(["down"]) == 0 and "owner already gone" in capsys.readouterr().out
    assert ClusterState.load() is None
