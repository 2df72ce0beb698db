"""``kvledger up / status / down``: start or join Ray, spawn the ranks, report, and stop exactly what was started.

``up`` in the foreground owns the cluster until Ctrl-C (or SIGTERM). ``up
--detach`` starts that same foreground owner (``kvledger.launch.owner``, handed
the options this process parsed and validated) as a background process in its
own session and returns once the owner reports the cluster healthy in the state
file. ``down`` kills the rank actors, then the owner and the processes it
started (by pid, checked against their start times); it never runs ``ray
stop``, so other Ray clusters on the machine are left alone.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from kvledger.coordinator.config import ClusterConfig
from kvledger.launch.state import ClusterState, descendants, is_alive, options_path, start_time, state_dir, state_path

if TYPE_CHECKING:  # the router actor's module imports Ray; ``status`` and ``down`` import this one without it
    from kvledger.coordinator.router_actor import RouterActorConfig

logger = logging.getLogger(__name__)
HEALTH_EVERY_S = 5.0
DETACH_WAIT_S = 180.0


@dataclass(frozen=True)
class UpOptions:
    """Everything ``kvledger up`` starts, validated: what the detached owner receives, pickled, from its parent."""

    cluster: ClusterConfig
    """The ranks (their ``cache`` geometry and budgets included)."""
    router: RouterActorConfig | None
    """The router actor and its HTTP API; ``None``: the ranks only (Python API)."""
    address: str | None = None
    """Join this Ray cluster (``host:port``) instead of starting one."""
    workload: Literal["bundled"] | None = None
    """Route the bundled workload through the cluster, print each request, then stop."""

    def __post_init__(self) -> None:
        if self.workload is not None and self.router is None:
            raise ValueError(f"the {self.workload} workload is sent through the router; drop --no-router")
        if self.cluster.num_ranks == 0:
            if self.router is None or not self.router.router.vllm:
                raise ValueError("--ranks 0 starts no rank of its own: give the router vLLM servers (--vllm URL)")
            if self.workload is not None:
                raise ValueError(f"the {self.workload} workload runs on kvledger's own ranks; --ranks 0 has none")


def _where(state: ClusterState) -> str:
    blocks = ("no ranks of its own" if state.block_counts is None else
              f"{state.block_counts[0]} device + {state.block_counts[1]} host blocks per rank")
    actors = f"actors {state.name_prefix}-0..{state.num_ranks - 1}" if state.num_ranks else "no rank actors"
    return (f"kvledger cluster up: {state.num_ranks} rank(s) on {state.device}, {blocks}\n"
            f"  Ray address   {state.address}  (namespace {state.namespace!r}, {actors})\n"
            f"  Python        from kvledger.coordinator.ray_env import init_ray; "
            f"from kvledger.coordinator.cluster import Cluster\n"
            f"                init_ray(address={state.address!r}, namespace={state.namespace!r}, ship_code=False); "
            f"cluster = Cluster.connect()\n"
            + "".join(f"  router {i:<6} {url}" + ("  (kvledger route PROMPT | kvledger monitor; "
                                                     "--router-index I for another replica)" if i == 0 else "") + "\n"
                      for i, url in enumerate(state.router_urls))
            + f"  state file    {state_path()}\n"
            f"  commands      kvledger status [--json] | kvledger down")


def _start_routers(cluster, config: RouterActorConfig, detached: bool, out: Callable[[str], None]) -> list:
    """Start the router replicas (HTTP API) over the ranks; ``(handle, url)`` of each, none when they cannot.

    Keep the handles while the routers are wanted: Ray ends a non-detached actor once no handle to it is left.
    """
    from kvledger.coordinator.router_actor import ROUTER_NAME, router_name, start_routers

    roles = tuple(range(cluster.config.prefill_ranks))   # the router's own roles come from the cluster's
    config = dataclasses.replace(config, router=dataclasses.replace(config.router, prefill_rank_ids=roles))
    try:
        return start_routers(cluster, config, name=ROUTER_NAME, detached=detached)
    except Exception as e:  # the ranks stay usable from Python; say why the HTTP API is missing
        _kill_routers([router_name(i) for i in range(config.routers)], cluster.config.namespace)
        out(f"the router did not start ({type(e).__name__}: {e}); the cluster is reachable from Python only")
        return []


def _kill_routers(names: list[str], namespace: str) -> None:
    import ray
    for name in names:
        try:
            ray.kill(ray.get_actor(name, namespace=namespace), no_restart=True)
        except ValueError:  # no actor of that name: already gone
            pass


def up(options: UpOptions, out: Callable[[str], None] = print) -> int:
    """Start (or join) Ray and the ranks; run the workload and stop, or hold the cluster until Ctrl-C/SIGTERM."""
    import ray

    from kvledger.coordinator.cluster import Cluster
    from kvledger.coordinator.ray_env import init_ray
    from kvledger.coordinator.router_actor import router_name

    config, address, workload = options.cluster, options.address, options.workload
    existing = ClusterState.load()
    if workload is None and existing is not None and is_alive(existing.owner_pid, existing.owner_start):
        out(f"a kvledger cluster is already up (owner pid {existing.owner_pid}, {state_path()}); "
            "run `kvledger down` first")
        return 1
    stop = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())
    num_cpus = max(os.cpu_count() or 1, math.ceil(config.num_ranks * config.num_cpus_per_rank))
    init_ray(address=address, num_cpus=num_cpus, namespace=config.namespace, log_to_driver=False)
    cluster = None
    routers: list = []  # (handle, url) of each replica: holding the handles keeps non-detached routers alive
    try:
        t0 = time.perf_counter()
        if config.num_ranks:
            cluster = Cluster.start(config)
            out(f"started {config.num_ranks} rank actor(s) on {cluster.device} in {time.perf_counter() - t0:.1f} s; "
                f"process group formed ({'nccl' if cluster.device == 'cuda' else 'gloo'}), "
                f"agreed block counts (device, host) = {cluster.block_counts}")
        else:
            cluster = Cluster(config, [], "cpu")
            out("no ranks of kvledger's own: the router fronts the vLLM servers only")
        if workload is not None:
            from kvledger.launch.workload import run_bundled
            assert options.router is not None, "UpOptions refuses a workload without a router"
            # A one-shot run takes any free port, so it never collides with a cluster already serving.
            one_shot = dataclasses.replace(options.router, port=0, routers=1)
            routers = _start_routers(cluster, one_shot, False, out)
            if not routers:
                return 1
            out(f"router on {routers[0][1]} (policy {one_shot.router.policy})")
            run_bundled(cluster, routers[0][1], out)
            return 0
        if options.router is not None:
            routers = _start_routers(cluster, options.router, config.detached, out)
        # Ray's services are this driver's children when it started Ray (the workers are theirs, found at `down`)
        pids = descendants(os.getpid(), depth=1) if address is None else []
        state = ClusterState(address=ray.get_runtime_context().gcs_address,
                             namespace=config.namespace, name_prefix=config.name_prefix,
                             num_ranks=config.num_ranks, prefill_ranks=config.prefill_ranks, device=cluster.device,
                             block_counts=None if cluster.block_counts is None else list(cluster.block_counts),
                             owner_pid=os.getpid(),
                             owner_start=start_time(os.getpid()), started_ray=address is None,
                             ray_pids=[p for p, _ in pids], ray_pid_starts=[s for _, s in pids],
                             router_urls=[url for _, url in routers],
                             router_names=[router_name(i) for i in range(len(routers))], ready=True)
        state.save()
        out(_where(state))
        out("holding the cluster; Ctrl-C stops it")
        sys.stdout.flush()
        while not stop.wait(HEALTH_EVERY_S):
            try:
                if not all(cluster.alive()):
                    out(f"rank(s) restarted: {cluster.heal()}; process group {cluster.generation} formed")
            except Exception as e:  # keep holding; status shows the rank as dead
                logger.warning("health check failed: %s", e)
        return 0
    except KeyboardInterrupt:
        return 0
    finally:
        signal.signal(signal.SIGTERM, previous)
        _kill_routers([router_name(i) for i in range(len(routers))], config.namespace)
        if cluster is not None:
            cluster.shutdown()
        st = ClusterState.load()
        if st is not None and st.owner_pid == os.getpid():
            ClusterState.remove()
        ray.shutdown()
        out("cluster stopped")


def up_detached(options: UpOptions, out: Callable[[str], None] = print) -> int:
    """Run ``up(options)`` in a background owner process in its own session; return once it is healthy.

    The options travel pickled (``options_path()``), already validated, so the owner runs exactly what this
    process parsed; ``kvledger.launch.owner`` loads them (and removes the file) and calls ``up``.
    """
    if options.workload is not None:
        raise ValueError("a workload runs and stops; it cannot run detached")
    existing = ClusterState.load()
    if existing is not None and is_alive(existing.owner_pid, existing.owner_start):
        out(f"a kvledger cluster is already up (owner pid {existing.owner_pid}); run `kvledger down` first")
        return 1
    ClusterState.remove()
    handoff = save_options(options)
    log = state_dir() / "up.log"
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "kvledger.launch.owner", str(handoff)], stdout=f,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                                env=os.environ.copy())
    deadline = time.monotonic() + DETACH_WAIT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            out(f"kvledger up exited with {proc.returncode} before the cluster was healthy; its log ({log}):\n"
                + log.read_text()[-3000:])
            return 1
        state = ClusterState.load()
        if state is not None and state.ready and state.owner_pid == proc.pid:
            out(_where(state))
            out(f"detached (owner pid {proc.pid}, log {log})")
            return 0
        time.sleep(0.5)  # the owner reports through the state file; nothing to wait on
    out(f"the cluster was not healthy within {DETACH_WAIT_S:g} s; stopping it (log {log})")
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
    return 1


def save_options(options: UpOptions) -> Path:
    """Write ``options`` for the detached owner: pickled, in a file only this user may read or write (loading a
    pickle runs whatever it holds)."""
    path = options_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.unlink(missing_ok=True)  # a left-over file would keep its own permissions
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        pickle.dump(options, f)
    tmp.replace(path)
    return path


def load_options(path: Path) -> UpOptions:
    """The options ``save_options`` wrote, removing the file: it hands one ``up`` over, once."""
    options = pickle.loads(path.read_bytes())
    path.unlink()
    if not isinstance(options, UpOptions):
        raise TypeError(f"{path} holds a {type(options).__name__}, not the UpOptions of `kvledger up --detach`")
    return options


def _reachable(address: str, timeout_s: float = 3.0) -> bool:
    """Whether something listens at the GCS address (``ray.init`` would retry for minutes otherwise)."""
    import socket
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False


def _connect(state: ClusterState):
    import ray

    if not _reachable(state.address):
        raise ConnectionError(f"nothing answers at {state.address}")

    from kvledger.coordinator.cluster import Cluster
    from kvledger.coordinator.ray_env import init_ray

    init_ray(address=state.address, namespace=state.namespace, ship_code=False, log_to_driver=False)
    config = ClusterConfig(namespace=state.namespace, name_prefix=state.name_prefix)
    if state.num_ranks == 0:   # the router alone, in front of vLLM servers: no rank actors to find
        return ray, Cluster(dataclasses.replace(config, num_ranks=0), [], state.device)
    return ray, Cluster.connect(config)


def status(as_json: bool = False, out: Callable[[str], None] = print) -> int:
    """Ranks, device, agreed block counts per tier, blocks in use, alive — of the cluster in the state file."""
    state = ClusterState.load()
    if state is None:
        out(f"no kvledger cluster is up (no state file at {state_path()})")
        return 1
    try:
        ray, cluster = _connect(state)
    except Exception as e:
        alive = is_alive(state.owner_pid, state.owner_start)
        out(f"the cluster in {state_path()} does not answer at {state.address} ({type(e).__name__}: {e}); "
            f"its owner (pid {state.owner_pid}) is {'alive' if alive else 'gone'}; `kvledger down` cleans up")
        return 1
    try:
        st = cluster.status()
    finally:
        ray.shutdown()
    st["address"] = state.address
    st["owner_pid"] = state.owner_pid
    st["router_url"] = state.router_url
    st["routers"] = _routers_view(state)
    st["router"] = _router_view(state.router_url)
    for r in st["ranks"]:
        r["role"] = "prefill" if r["rank"] < state.prefill_ranks else "serve"
    if as_json:
        out(json.dumps(st, indent=2, default=str))
        return 0
    agreed = st["agreed_blocks"]
    pools = [agreed] if agreed is None or "windows" not in agreed else agreed["windows"]
    blocks = ("no ranks of its own" if not st["num_ranks"] else "no agreed block counts yet" if agreed is None
              else "agreed blocks per rank: " + "; ".join(f"{p['device']} device, {p['host']} host"
                                                          + (f" (window {i})" if len(pools) > 1 else "")
                                                          for i, p in enumerate(pools)))
    out(f"cluster at {state.address}: {st['num_ranks']} rank(s), device {st['device']}, {blocks}; "
        + (f"{len(state.router_urls)} router(s)" if state.router_urls else "router not running"))
    for r in st["routers"]:
        out(f"router {r['index']}: {r['url']} {r['state']} (actor {r['name']})")
    out(f"{'rank':>4} {'role':>7} {'alive':>5} {'device':>7} {'in use':>7} {'free':>7} {'host in use':>11} "
        f"{'served':>6}")
    for r in st["ranks"]:
        if not r["alive"]:
            out(f"{r['rank']:>4} {r['role']:>7} {'no':>5}")
            continue
        out(f"{r['rank']:>4} {r['role']:>7} {'yes':>5} {r.get('device', '-'):>7} {r.get('device_blocks_used', '-'):>7} "
            f"{r.get('device_blocks_free', '-'):>7} {r.get('host_blocks_used', '-'):>11} {r['served_requests']:>6}")
        if len(r.get("windows", ())) > 1:   # in use and free above sum pools that no request can pool
            out("     pools: " + "; ".join(f"window {w['window'] or 'full'}: {w['device']} device, {w['host']} host"
                                          for w in r["windows"]))
    view = st["router"]
    if view is not None and "error" in view:
        out(f"router: {view['error']}")
    elif view is not None:
        t = view["router"]
        ratio = "-" if t["delivered_ratio"] is None else f"{t['delivered_ratio']:.2f}"
        out(f"router: {t['completions']} completions, cached tokens delivered/predicted {ratio}, "
            f"{t['events_rejected']} events rejected")
        for t in view["tenants"]:
            wait = "-" if t["mean_queue_s"] is None else f"{t['mean_queue_s']:.3f} s"
            out(f"tenant {t['tenant']}: weight {t['weight']:g}, {t['running']} running, {t['queued']} queued, "
                f"{t['served']} served ({t['token_share']:.0%} of tokens), {t['shed']} shed, mean wait {wait}")
        s = view["sessions"]
        out(f"sessions: {s['live']} live, {s['waiting_on_tool']} waiting on a tool, hit rate {s['hit_rate']:.0%} "
            f"over {s['turns']} turn(s)")
        for f in view["foreign"]:
            dp = "" if f["data_parallel_rank"] is None else f" data-parallel rank {f['data_parallel_rank']}"
            role = ", prefill only" if f["prefill_only"] else ""
            out(f"vLLM rank {f['rank']}: {f['endpoint']}{dp} {'live' if f['live'] else 'DOWN'}{role}, "
                f"{f['block_size']} tokens per block, {f['index_blocks']} blocks indexed "
                f"({f['host_blocks']} on its host tier only)")
        for r in view["ranks"]:
            if r.get("prefill_s_per_token") is not None:
                decode = r.get("decode_s_per_token")
                out(f"rank {r['rank']}: learned {r['prefill_s_per_token'] * 1e6:.1f} us per uncached prompt token"
                    + ("" if decode is None else f", {decode * 1e3:.2f} ms per decoded token"))
        for r in {r["rank"]: r for r in [*view["ranks"], *view["foreign"]]}.values():
            if r["rejected"]:
                out(f"rank {r['rank']}: events rejected " + ", ".join(f"{n} {why}" for why, n in r["rejected"].items()))
    return 0 if all(r["alive"] for r in st["ranks"]) else 2


def _routers_view(state: ClusterState) -> list[dict]:
    """Each router replica the state file lists, with what it says of itself now (``router_state``)."""
    from kvledger.launch.router_client import router_state
    return [{"index": i, "url": url, "name": name, "state": router_state(url)}
            for i, (url, name) in enumerate(zip(state.router_urls, state.router_names))]


def _router_view(url: str | None) -> dict | None:
    """The router's own report (``GET /v1/cluster``), or why it could not be read."""
    if url is None:
        return None
    import httpx

    from kvledger.launch.router_client import auth_headers
    try:
        r = httpx.get(f"{url}/v1/cluster", headers=auth_headers(), timeout=10.0)
    except httpx.HTTPError as e:
        return {"error": f"{url} does not answer ({type(e).__name__}: {e}); Ray restarts a router that died"}
    if r.status_code != 200:   # starting (503), or a key that is not an admin's
        return {"error": f"{url} answered {r.status_code}: {r.json().get('error', {}).get('message', r.text)}"}
    return r.json()


def down(out: Callable[[str], None] = print, grace_s: float = 30.0) -> int:
    """Kill the rank actors, then the ``up`` owner and every process it started; remove the state file."""
    state = ClusterState.load()
    if state is None:
        out(f"no kvledger cluster is up (no state file at {state_path()})")
        return 1
    owner_alive = is_alive(state.owner_pid, state.owner_start)
    try:
        ray, cluster = _connect(state)
        try:
            _kill_routers(state.router_names, state.namespace)
            cluster.shutdown()
            n = len(state.router_names)
            out(f"killed {state.num_ranks} rank actor(s)" + (f" and {n} router(s)" if n else ""))
        finally:
            ray.shutdown()
    except Exception as e:  # the Ray may already be gone; the processes below are still ours to stop
        out(f"could not reach the cluster at {state.address} ({type(e).__name__}: {e}); stopping its processes")
    ours = list(zip(state.ray_pids, state.ray_pid_starts))
    if owner_alive:
        ours = [(state.owner_pid, state.owner_start), *descendants(state.owner_pid), *ours]
        os.kill(state.owner_pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while is_alive(state.owner_pid, state.owner_start) and time.monotonic() < deadline:
            time.sleep(0.2)  # waiting for another process to exit: no event to wait on
    killed = 0
    for pid, st in dict(ours).items():
        if st is not None and is_alive(pid, st):
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except ProcessLookupError:
                pass
    ClusterState.remove()
    deadline = time.monotonic() + 5.0
    while True:
        left = [pid for pid, st in dict(ours).items() if st is not None and is_alive(pid, st)]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    out(f"cluster down ({'stopped' if owner_alive else 'owner already gone'}; {killed} process(es) killed"
        f"{'; still alive: ' + str(left) if left else ''})")
    return 0 if not left else 1
