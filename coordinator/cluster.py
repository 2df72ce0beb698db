"""The cluster: rank actors in a placement group, their process group, agreed block counts, health, migration.

``Cluster.start`` spawns one rank actor per rank (named, in one namespace),
forms the ``torch.distributed`` group (rank 0 opens a TCP store on an
OS-chosen port, every rank joins with the backend ``kvledger.worker.device``
picks), and has the ranks all-reduce their block counts with ``MIN`` so every
ledger has the same size. ``Cluster.connect`` finds the actors of a running
(detached) cluster again by name.

A ``Cluster`` is also the router's ``RankSet``: a typed client per rank
(``RayRankClient``), the ranks believed live (a rank lost on any call leaves
until ``check_health`` sees it ready again: the one liveness poll, which
``heal`` and ``status`` use too), and migrations through the one choreography
of ``kvledger.coordinator.migration`` with a ``torch.distributed`` send and
receive between the two actors.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Sequence

import ray
from ray.exceptions import GetTimeoutError, RayActorError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from kvledger.coordinator.config import ClusterConfig
from kvledger.coordinator.migration import Migrator
from kvledger.coordinator.rank_client import RayRankClient
from kvledger.router.liveness import Liveness
from kvledger.router.rank_client import RankDiedError
from kvledger.worker.rank.actor import rank_actor_class
from kvledger.worker.rank.worker import RankWorker
from kvledger.worker.wire.messages import ExportTicket, ImportTicket, RankLoad

logger = logging.getLogger(__name__)

#: Timeout of the short calls (load, probe, the migration's bookkeeping steps).
QUICK_TIMEOUT_S = 10.0


class ClusterError(RuntimeError):
    """The cluster could not be formed or reached."""


def _resolve_device(config: ClusterConfig) -> str:
    gpus = ray.cluster_resources().get("GPU", 0)
    if config.device == "cuda" and gpus < config.num_ranks:
        raise ValueError(f"--device cuda needs one GPU per rank: {config.num_ranks} ranks, {gpus:g} GPUs in the "
                         "Ray cluster")
    if config.device == "auto":
        return "cuda" if gpus >= config.num_ranks else "cpu"
    return config.device


def _strategy(config: ClusterConfig) -> str:
    if config.placement_strategy != "auto":
        return config.placement_strategy
    alive = [n for n in ray.nodes() if n.get("Alive")]
    return "SPREAD" if len(alive) > 1 else "PACK"


class Cluster:
    """Handles to the rank actors of one cluster, their typed clients, and what the coordinator does with them."""

    def __init__(self, config: ClusterConfig, actors: list, device: str, placement=None,
                 quick_timeout_s: float = QUICK_TIMEOUT_S) -> None:
        self.config = config
        self.actors = actors
        self.device = device
        self.placement = placement
        self.block_counts: tuple[int, int] | None = None
        self.generation = 0
        self.quick_timeout_s = quick_timeout_s
        self.clients = [RayRankClient(r, a, quick_timeout_s, config.call_timeout_s, self.mark_down)
                        for r, a in enumerate(actors)]
        self.migrator = Migrator(self.client, self._mover)
        self.liveness = Liveness()
        self._group_lock = threading.Lock()

    # ------------------------------------------------------------------ lifecycle

    @classmethod
    def start(cls, config: ClusterConfig, worker_cls: type[RankWorker] = RankWorker) -> Cluster:
        """Spawn the rank actors (Ray must be initialised), form the group, agree block counts.

        ``worker_cls`` is what each actor runs: ``RankWorker``, or a subclass (benchmarks add raw transfers).
        """
        if config.num_ranks == 0:
            raise ValueError("a cluster of 0 ranks has no actors to start (`kvledger up --ranks 0` runs the router "
                             "alone, in front of vLLM servers)")
        device = _resolve_device(config)
        n = config.num_ranks
        gpu = device == "cuda"
        bundle = {"GPU": 1, "CPU": 1} if gpu else {"CPU": config.num_cpus_per_rank}
        pg_opts = {"name": f"{config.name_prefix}-pg"}
        if config.detached:
            pg_opts["lifetime"] = "detached"
        pg = placement_group([dict(bundle) for _ in range(n)], strategy=_strategy(config), **pg_opts)
        try:
            ray.get(pg.ready(), timeout=config.call_timeout_s)
        except GetTimeoutError:
            remove_placement_group(pg)
            raise ClusterError(f"the placement group of {n} x {bundle} was not placed within "
                               f"{config.call_timeout_s:g} s: not enough resources in the Ray cluster "
                               f"({ray.available_resources()})") from None
        actor_cls = rank_actor_class(worker_cls)
        actors = []
        for i in range(n):
            cache = config.cache
            if config.primary_bytes_per_rank is not None:
                cache = dataclasses.replace(cache, primary_bytes=config.primary_bytes_per_rank[i])
            if gpu and config.primary_bytes_per_rank is None and config.gpu_memory_fraction is not None:
                cache = dataclasses.replace(cache, primary_bytes=None)  # a share of free GPU memory instead
            cache = dataclasses.replace(cache, device="cpu" if not gpu else "auto")
            opts = dict(name=f"{config.name_prefix}-{i}", namespace=config.namespace,
                        num_cpus=1 if gpu else config.num_cpus_per_rank, num_gpus=1 if gpu else 0,
                        max_restarts=config.max_restarts, max_task_retries=0,
                        scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i))
            if config.detached:
                opts["lifetime"] = "detached"
            fraction = config.gpu_memory_fraction or 0.5
            actors.append(actor_cls.options(**opts).remote(i, n, cache, config.seed, fraction))
        cluster = cls(config, actors, device, pg)
        try:
            cluster.form_group()
        except BaseException:
            cluster.shutdown()
            raise
        return cluster

    @classmethod
    def connect(cls, config: ClusterConfig | None = None) -> Cluster:
        """Find the named rank actors of a running cluster (Ray must be initialised in its namespace)."""
        config = config or ClusterConfig()
        names = sorted((a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                        if a["namespace"] == config.namespace and a["name"].startswith(config.name_prefix + "-")
                        and a["name"].rsplit("-", 1)[1].isdigit()), key=lambda s: int(s.rsplit("-", 1)[1]))
        if not names:
            raise ClusterError(f"no kvledger rank actors in namespace {config.namespace!r}")
        actors = [ray.get_actor(name, namespace=config.namespace) for name in names]
        config = dataclasses.replace(config, num_ranks=len(actors))
        cluster = cls(config, actors, device="unknown")
        for client in cluster.clients:
            try:
                info = client.info()
            except RankDiedError:
                continue
            if info.ready:
                cluster.device = info.device.split(":")[0]
                cluster.block_counts = (info.device_blocks, info.host_blocks)
                break
        return cluster

    def shutdown(self) -> None:
        """Kill the rank actors and remove their placement group."""
        for a in self.actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception:  # already gone
                pass
        if self.placement is not None:
            try:
                remove_placement_group(self.placement)
            except Exception:
                pass
        else:
            try:
                remove_placement_group(ray.util.get_placement_group(f"{self.config.name_prefix}-pg"))
            except Exception:
                pass
        self.actors, self.clients = [], []

    # ------------------------------------------------------------------ process group

    def get(self, refs, timeout: float | None = None):
        """``ray.get`` with the cluster's call timeout (every wait on an actor has one)."""
        return ray.get(refs, timeout=self.config.call_timeout_s if timeout is None else timeout)

    def form_group(self) -> tuple[int, int]:
        """(Re)form the process group over every rank, then agree block counts with a MIN all-reduce."""
        with self._group_lock:
            self.generation += 1
            t = self.config.group_timeout_s
            self.get([a.leave_group.remote() for a in self.actors])
            host = self.get(self.actors[0].node_ip.remote())
            port = self.get(self.actors[0].open_store.remote(host, t))
            self.get([a.join_group.remote(host, port, t, self.generation) for a in self.actors], t + 30)
            counts = self.get([a.agree_block_counts.remote() for a in self.actors], t + 30)
            if len(set(counts)) != 1:
                raise ClusterError(f"ranks disagree on block counts after the all-reduce: {counts}")
            self.block_counts = tuple(counts[0])
            logger.info("process group %d formed: %d ranks, %s blocks per tier", self.generation,
                        len(self.actors), self.block_counts)
            return self.block_counts

    # ------------------------------------------------------------------ the router's RankSet

    def live(self) -> list[int]:
        return self.liveness.live(range(len(self.clients)))

    def client(self, rank: int) -> RayRankClient:
        if not 0 <= rank < len(self.clients):
            raise ValueError(f"no rank {rank!r} in a cluster of {len(self.clients)} ranks")
        self.liveness.check(rank)
        return self.clients[rank]

    def mark_down(self, rank: int) -> None:
        self.liveness.mark_down(rank)

    def migrate(self, tokens: Sequence[int], src: int, dst: int, max_blocks: int | None = None,
                lora_id: int | None = None, cache_salt: str | None = None) -> int:
        return self.migrator.migrate(tokens, src, dst, max_blocks, lora_id, cache_salt).sent_blocks

    def _mover(self, src: int, dst: int) -> _ProcessGroupMover:
        return _ProcessGroupMover(self, src, dst)

    def probe(self, tokens: Sequence[int], lora_id: int | None = None, cache_salt: str | None = None) -> list[int]:
        """Exact probe of every rank: matched tokens per rank (-1 for a rank that does not answer)."""
        out = []
        for r in range(len(self.clients)):
            try:
                out.append(self.client(r).probe(tokens, lora_id, cache_salt))
            except RankDiedError:
                out.append(-1)
        return out

    # ------------------------------------------------------------------ health

    def health(self) -> list[RankLoad | None]:
        """Every rank's load report, asked all at once; ``None`` for a rank that does not answer in time."""
        refs = [a.load.remote() for a in self.actors]
        out: list[RankLoad | None] = []
        for ref in refs:
            try:
                out.append(ray.get(ref, timeout=self.quick_timeout_s))
            except (RayActorError, GetTimeoutError):
                out.append(None)
        return out

    def check_health(self) -> list[int]:
        """Update who is live from one health round (a rank without a ledger is down); returns the ranks back."""
        return self.liveness.update({r: load is not None and load.ready for r, load in enumerate(self.health())})

    def alive(self) -> list[bool]:
        """Whether each rank answers now (a restarting rank does not)."""
        return [load is not None for load in self.health()]

    def heal(self, timeout_s: float = 90.0, poll_s: float = 0.5) -> list[int]:
        """Wait until every rank is back (Ray restarts dead ones), then re-form the group if any had restarted.

        A restarted rank comes back with no ledger; re-forming the group includes
        it and agrees block counts again (the survivors keep their ledgers, and
        their caches, when the agreed counts are unchanged). Returns the ranks
        that had restarted; raises ``ClusterError`` when one is not back in time.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            loads = self.health()
            if all(load is not None for load in loads):
                break
            if time.monotonic() >= deadline:
                gone = [r for r, load in enumerate(loads) if load is None]
                raise ClusterError(f"rank(s) {gone} did not come back within {timeout_s:g} s")
            time.sleep(poll_s)  # the actors are restarting; Ray reports no event to wait on
        restarted = [r for r, load in enumerate(loads) if not load.ready]
        if restarted:
            logger.warning("rank(s) %s restarted: re-forming the process group", restarted)
            self.form_group()
            self.check_health()
        return restarted

    # ------------------------------------------------------------------ reports

    def status(self) -> dict:
        """Ranks, device, agreed block counts per tier, blocks in use, whether each rank is alive."""
        ranks = []
        for r, load in enumerate(self.health()):
            if load is None:
                ranks.append({"rank": r, "alive": False})
                continue
            entry = {"alive": True, **dataclasses.asdict(load)}
            if load.ready:
                try:
                    info = self.clients[r].info()
                except RankDiedError as e:
                    ranks.append({"rank": r, "alive": False, "error": e.reason})
                    continue
                entry.update(device=info.device, backend=info.backend, in_group=info.in_group,
                             device_blocks=info.device_blocks, host_blocks=info.host_blocks)
            ranks.append(entry)
        return {"num_ranks": len(self.actors), "device": self.device, "generation": self.generation,
                "agreed_blocks": None if self.block_counts is None else
                {"device": self.block_counts[0], "host": self.block_counts[1]},
                "ranks": ranks, "time": time.time()}


class _ProcessGroupMover:
    """A migration's bytes as one ``torch.distributed`` send from the source actor and one receive on the target."""

    def __init__(self, cluster: Cluster, src: int, dst: int) -> None:
        self.cluster, self.src, self.dst = cluster, src, dst

    def move(self, export: ExportTicket, start: int, target: ImportTicket) -> int:
        a, b = self.cluster.actors[self.src], self.cluster.actors[self.dst]
        send = a.export_send.remote(export.pin_id, start, self.dst)
        recv = b.import_recv.remote(target.import_id, self.src)
        try:
            nbytes, got = ray.get([send, recv], timeout=self.cluster.config.group_timeout_s + 30)
        except BaseException as e:
            for ref in (send, recv):
                ray.cancel(ref, force=False)
            if isinstance(e, RayActorError):
                raise RankDiedError(self._which_died(), f"it died during a migration ({type(e).__name__})") from e
            raise
        assert got == target.blocks, f"rank {self.dst} stored {got} blocks, {target.blocks} were sent"
        return nbytes

    def _which_died(self) -> int:
        for r in (self.src, self.dst):
            try:
                self.cluster.clients[r].wait(self.cluster.actors[r].ping.remote(), "ping")
            except RankDiedError:
                return r
        return self.src
