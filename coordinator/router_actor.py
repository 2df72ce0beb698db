"""The router actor: a ``RouterService`` over the cluster's ranks, serving the HTTP API from its own process.

Events travel by push. Each rank actor runs a publisher thread that drains its
ledger every ``push_interval_s`` (5 ms) and, only when something happened,
calls ``ingest`` on this actor, fire-and-forget. Pushing costs nothing while
the cluster is idle (a router pulling would make one call per rank per
interval, events or not), and the rank, which knows when it has events, sets
the pace. A batch that arrives out of order or gets lost shows as a gap in the
numbering, which the service closes by asking that rank for a replay.
Besides, a request the router sends is served with ``publish=True``: the
rank publishes the events that request caused before it lets go of its ledger
and returns them with the result, so a completion's blocks are in the index
when the HTTP answer leaves (the next request sharing its prefix is routed on
them), without waiting behind whatever the rank serves next.

The actor is sequential (``max_concurrency=1``): Ray runs one caller's calls
in order, so each rank's pushes arrive in order. The HTTP server runs on its
own thread in the same process, and a maintenance thread every
``health_interval_s`` checks the ranks, re-attaches the publisher of a rank
that restarted, snapshots ranks the index does not know, and refreshes loads.
``RouterHost`` is the plain class; ``router_actor_class()`` wraps it.

Replicas (``routers`` > 1, ``start_routers``) are router actors named
``router_name(i, base)``, each on its own port, each attached to every rank: a
rank pushes each batch to all of them, so they build the same index from the
same streams, and a replica that restarts re-attaches only itself. Each tells
the others every dispatch it makes and every one that finishes
(``router.replica_sync``, over Ray actor calls: ``coordinator.replica_link``),
so each weighs the others' requests in flight from the moment they are sent;
a replica found dead or restarted has its dispatches dropped by the others.
``peer_sync`` returns once the peers have applied all this replica sent before
it (what tests wait on). The ranks' load reports add only what clients the
routers never saw sent, read less what ended since they were asked.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import socket
import threading
from dataclasses import dataclass, field

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from kvledger.coordinator.cluster import Cluster
from kvledger.coordinator.config import ClusterConfig
from kvledger.coordinator.replica_link import RayPeers
from kvledger.router.array_index import warm_kernels
from kvledger.router.config import RouterConfig
from kvledger.router.feed import parse_vllm_endpoint
from kvledger.router.http import DEFAULT_HOST, DEFAULT_PORT, HttpServer, make_app
from kvledger.router.rank_client import RankDiedError
from kvledger.router.replica_sync import PeerBatch, ReplicaSync
from kvledger.router.service import RouterService
from kvledger.router.tenants import ApiKeys, is_loopback
from kvledger.worker.rank.faults import TransportFaults

logger = logging.getLogger(__name__)

ROUTER_NAME = "kvledger-router"


def router_name(index: int, base: str = ROUTER_NAME) -> str:
    """The actor name of replica ``index``: ``base`` for the first (as before replicas), ``base-1``... after."""
    return base if index == 0 else f"{base}-{index}"


@dataclass
class RouterActorConfig:
    """Where the router listens and how it keeps up with the ranks; ``kvledger up`` builds flags from these."""

    host: str = DEFAULT_HOST
    """Interface of the HTTP API (127.0.0.1: this machine only)."""
    port: int = DEFAULT_PORT
    """Port of the HTTP API (0: any free port; the actor reports the one it got); replica i listens on port + i."""
    routers: int = 1
    """Router replicas, each an actor with its own HTTP port and its own index fed by every rank's events."""
    router: RouterConfig = field(default_factory=RouterConfig)
    push_interval_s: float = 0.005
    """How often each rank drains its ledger and pushes a batch (when it has events)."""
    health_interval_s: float = 1.0
    """How often the router checks ranks, re-attaches publishers and refreshes loads."""
    vllm_events: tuple[str, ...] = ()
    """Real vLLM engines to index too: ``tcp://HOST:PORT[,tcp://HOST:REPLAY_PORT]`` each."""
    api_keys: str | None = None
    """A file of API keys, one ``KEY TENANT ROLE`` a line (role ``user`` or ``admin``): every request then needs a
    key, tenants share no cached blocks, and events, cluster report and metrics need an admin key."""
    allow_unauthenticated: bool = False
    """Serve without keys on an address other than loopback (anyone who reaches it sees every tenant's events)."""
    max_restarts: int = -1
    """How often Ray restarts the router after it dies (-1: always); it comes back on the same port."""
    transport_faults: TransportFaults = field(default_factory=TransportFaults)
    """Faults injected into the ranks' event pushes (off by default; the chaos run and the tests turn them on)."""

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port!r}")
        if type(self.routers) is not int or self.routers < 1:
            raise ValueError(f"routers must be an int >= 1, got {self.routers!r}")
        if self.port and self.port + self.routers - 1 > 65535:
            raise ValueError(f"{self.routers} routers from port {self.port} would need ports past 65535")
        if self.api_keys is not None:
            ApiKeys.load(self.api_keys)   # a bad file fails here, naming its line
        elif not is_loopback(self.host) and not self.allow_unauthenticated:
            raise ValueError(f"host {self.host} is reachable from other machines and there are no api_keys: give "
                             "--api-keys FILE, or --allow-unauthenticated to serve it open")
        if type(self.max_restarts) is not int or self.max_restarts < -1:
            raise ValueError(f"max_restarts must be an int >= -1, got {self.max_restarts!r}")
        if not self.push_interval_s > 0 or not self.health_interval_s > 0:
            raise ValueError("push_interval_s and health_interval_s must be > 0")
        for spec in self.vllm_events:
            parse_vllm_endpoint(spec)


class RouterHost:
    """The router's process: service, HTTP server, maintenance (see the module docstring)."""

    def __init__(self, cluster_config: ClusterConfig, device: str, config: RouterActorConfig,
                 name: str = ROUTER_NAME, replica: int = 0) -> None:
        """This is replica ``replica`` of ``config.routers`` named after ``name``. The rank actors and the other
        replicas are found by name, not passed: an actor handle among a restartable actor's arguments puts them
        in the object store, where a restart could find them gone."""
        self.config = config
        actors = [ray.get_actor(f"{cluster_config.name_prefix}-{i}", namespace=cluster_config.namespace)
                  for i in range(cluster_config.num_ranks)]
        self.cluster = Cluster(cluster_config, actors, device)
        self.service = RouterService(self.cluster if actors else None, config.router)
        peers = [router_name(i, name) for i in range(config.routers) if i != replica]
        self.sync = ReplicaSync(router_name(replica, name), peers,
                                RayPeers(cluster_config.namespace, self.cluster.quick_timeout_s).send, self.service,
                                config.health_interval_s, self.cluster.quick_timeout_s)
        self.service.listen(self.sync)
        self.sync.start()
        self._self_handle = _own_handle()
        # what the ranks know this replica's pushes by: its actor id, which a restart keeps (None outside an
        # actor, where there is no handle to push to either)
        self._push_id = ray.get_runtime_context().get_actor_id()
        self._stop = threading.Event()
        self._round = threading.Lock()
        keys = None if config.api_keys is None else ApiKeys.load(config.api_keys)
        # Listen at once, answering 503 until the index is rebuilt: a restarted router is never a hang.
        self.ready = threading.Event()
        self.server = HttpServer(make_app(self.service, keys, self.ready), config.host, config.port).start()
        warm_kernels()   # compiled (or read from the disk cache) before the snapshots and the first probe
        # snapshot first, then attach: the first batch a rank pushes then follows its snapshot's number,
        # where a batch 0 arriving after the snapshot would read as a restart and cost a second one
        self.service.feed.sync()
        self._attach_all()
        self.service.refresh_loads(force=True)   # block counts from the first request on
        self.ready.set()
        for spec in config.vllm_events:
            self.service.feed.attach_vllm(*parse_vllm_endpoint(spec))
        self._maintenance = threading.Thread(target=self._maintain, name="kvledger-router-maintenance", daemon=True)
        self._maintenance.start()

    def url(self) -> str:
        return self.server.url

    def ingest(self, rank: int, seq: int, data: bytes) -> str:
        """A rank's pushed batch; returns what the index did with it (``ApplyStatus`` value)."""
        return self.service.feed.ingest(rank, seq, data).status.value

    def peer_events(self, batch: PeerBatch) -> int:
        """Another replica's dispatches and finishes (``ReplicaSync.receive``): how many it has applied since its
        last reset."""
        return self.sync.receive(batch)

    @ray.method(concurrency_group="sync")
    def peer_sync(self, timeout_s: float = 30.0) -> dict[str, int]:
        """Once every other replica has applied what this one sent before the call (``ReplicaSync.flush``): each
        with how many of its events it has applied since its last reset. In a group of its own, so the wait holds
        up neither the ranks' pushes nor the peers' batches to this replica."""
        return self.sync.flush(timeout_s)

    def ping(self) -> bool:
        return True

    def push_id(self) -> str | None:
        """What the ranks know this replica's pushes by (``None`` outside an actor, where nothing is pushed)."""
        return self._push_id

    def pid(self) -> int:
        """The router's process (what a chaos test kills)."""
        return os.getpid()

    def stop(self) -> None:
        self._stop.set()
        self.server.stop()
        self.sync.close()
        self.service.close()

    def _attach_all(self) -> None:
        if self._self_handle is None or self._push_id is None:
            return
        for r in self.cluster.live():
            try:   # a rank lost here is marked down by its client
                self.cluster.client(r).attach_router(self._self_handle, self._push_id, self.config.push_interval_s,
                                                     self.config.transport_faults)
            except RankDiedError:
                continue

    def maintenance_round(self) -> list[int]:
        """One round now, as the maintenance thread runs every ``health_interval_s``: health, publishers, loads.
        Returns the ranks that came back (a caller that just healed one need not wait for the next round)."""
        with self._round:
            back = self.service.check_health()   # own ranks and vLLM servers alike; the index follows
            if back:
                logger.info("rank(s) %s are back", back)
            self._attach_all()   # idempotent; restarts the publisher of a rank that restarted
            self.service.refresh_loads(force=True)
            return back

    def _maintain(self) -> None:
        while not self._stop.wait(self.config.health_interval_s):
            try:
                self.maintenance_round()
            except Exception:  # keep maintaining: one bad round must not stop the router's upkeep
                logger.exception("router maintenance round failed")


def _own_handle():
    """This actor's handle (for the ranks to push to), or ``None`` outside an actor (a plain ``RouterHost``)."""
    try:
        return ray.get_runtime_context().current_actor
    except RuntimeError:
        return None


def free_port(host: str) -> int:
    """A port free on ``host`` now (the OS picks it; the router binds it moments later, on this node)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def router_actor_class():
    """``RouterHost`` as a Ray actor (sequential: one caller's pushes run in order; ``peer_sync`` waits apart)."""
    return ray.remote(max_concurrency=1, concurrency_groups={"sync": 1})(RouterHost)


def start_router(cluster: Cluster, config: RouterActorConfig = RouterActorConfig(), name: str = ROUTER_NAME,
                 detached: bool = False, timeout_s: float = 120.0):
    """Spawn the router actor on this node (its HTTP API binds here); returns ``(handle, url)``."""
    ((handle, url),) = start_routers(cluster, dataclasses.replace(config, routers=1), name, detached, timeout_s)
    return handle, url


def start_routers(cluster: Cluster, config: RouterActorConfig = RouterActorConfig(), name: str = ROUTER_NAME,
                  detached: bool = False, timeout_s: float = 120.0) -> list[tuple[ray.actor.ActorHandle, str]]:
    """Spawn ``config.routers`` replicas on this node, named ``router_name(i, name)``, replica i on
    ``config.port + i`` (each on a free port of its own when it is 0); ``(handle, url)`` of each, in order.

    They start side by side; each snapshots the ranks, attaches itself to them and calls the others to share
    its dispatches.
    """
    tpb = cluster.config.cache.tokens_per_block
    if config.router.tokens_per_block != tpb:
        config = dataclasses.replace(config, router=dataclasses.replace(config.router, tokens_per_block=tpb))
    if cluster.actors and cluster.block_counts is None:
        raise ValueError("the cluster has not agreed block counts yet; start the router after Cluster.start")
    opts = dict(namespace=cluster.config.namespace, num_cpus=0, max_restarts=config.max_restarts,
                scheduling_strategy=NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(),
                                                                   soft=False))
    if detached:
        opts["lifetime"] = "detached"
    cls = router_actor_class()
    handles, ports = [], set()
    for i in range(config.routers):
        # a restart binds the port the first start got; each replica a port of its own
        port = config.port + i if config.port else 0
        while port == 0 or port in ports:
            port = free_port(config.host)
        ports.add(port)
        handles.append(cls.options(name=router_name(i, name), **opts).remote(
            cluster.config, cluster.device, dataclasses.replace(config, port=port), name, i))
    urls = ray.get([h.url.remote() for h in handles], timeout=timeout_s)
    return list(zip(handles, urls))
