"""The cluster: rank actors in a placement group, their process group, agreed block counts, health, migration.

``Cluster.start`` spawns one rank actor per rank (named, in one namespace),
forms the ``torch.distributed`` group (rank 0 opens a TCP store on an
OS-chosen port, every rank joins with the backend ``kvledger.worker.device``
picks), and has the ranks all-reduce their block counts with ``MIN`` so every
ledger has the same size. ``Cluster.connect`` finds the actors of a running
(detached) cluster again by name.

A ``Cluster`` is also the router's ``RankSet``: a typed client per rank
(``RayRankClient``, through which every call to a rank actor goes), the ranks believed live (a rank lost on any call leaves
until ``check_health`` sees it ready again: the one liveness poll, which
``heal`` and ``status`` use too), and migrations through the one choreography
of ``kvledger.coordinator.migration`` with a ``torch.distributed`` send and
receive between the two actors.
"""
from __future__ import annotations

import dataclasses
import logging
import random
import threading
import time
from collections.abc import Sequence

import ray
from ray.exceptions import GetTimeoutError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from kvledger.coordinator.config import ClusterConfig
from kvledger.coordinator.migration import MigrationResult, Migrator
from kvledger.coordinator.rank_client import PendingCall, RayRankClient
from kvledger.router.liveness import Liveness
from kvledger.router.rank_client import RankDiedError
from kvledger.worker.rank.actor import rank_actor_class
from kvledger.worker.rank.faults import CrashPoint, CrashSpec
from kvledger.worker.rank.worker import RankWorker
from kvledger.worker.wire.messages import RankLoad

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
        self.device = device
        self.placement = placement
        self.block_counts: tuple[int, int] | None = None
        self.generation = 0
        self.quick_timeout_s = quick_timeout_s
        self.clients = [RayRankClient(r, a, quick_timeout_s, config.call_timeout_s, self.mark_down)
                        for r, a in enumerate(actors)]
        self.migrator = Migrator(_GroupTransfer(self))
        self.liveness = Liveness()
        self._group_lock = threading.Lock()

    @property
    def actors(self) -> list[ray.actor.ActorHandle]:
        """The rank actors' handles, for killing them (tests, chaos); calls go through ``clients``."""
        return [c.actor for c in self.clients]

    # ------------------------------------------------------------------ lifecycle

    @classmethod
    def start(cls, config: ClusterConfig, worker_cls: type[RankWorker] = RankWorker,
              crashes: Sequence[CrashSpec] = ()) -> Cluster:
        """Spawn the rank actors (Ray must be initialised), form the group, agree block counts.

        ``worker_cls`` is what each actor runs: ``RankWorker``, or a subclass (benchmarks add raw transfers).
        ``crashes`` are armed once the group is formed (tests and the chaos run; off by default): only in each
        actor's first incarnation, since an actor Ray restarts comes back with nothing armed.
        """
        if config.num_ranks == 0:
            raise ValueError("a cluster of 0 ranks has no actors to start (`kvledger up --ranks 0` runs the router "
                             "alone, in front of vLLM servers)")
        for spec in crashes:
            if not isinstance(spec, CrashSpec) or spec.rank >= config.num_ranks:
                raise ValueError(f"crashes must be CrashSpecs of ranks 0..{config.num_ranks - 1}, got {spec!r}")
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
        batching = config.batching()
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
                        max_restarts=config.max_restarts, max_task_retries=0, max_concurrency=batching.actor_threads,
                        scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i))
            if config.detached:
                opts["lifetime"] = "detached"
            fraction = config.gpu_memory_fraction or 0.5
            actors.append(actor_cls.options(**opts).remote(i, n, cache, config.seed, fraction, batching=batching))
        cluster = cls(config, actors, device, pg)
        try:
            cluster.form_group()
            for spec in crashes:
                cluster.arm_crash(spec.rank, spec.point, spec.after)
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
                cluster.block_counts = tuple(n for _, d, h in info.windows for n in (d, h))   # as form_group has them
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
        self.clients = []

    # ------------------------------------------------------------------ process group

    def form_group(self) -> tuple[int, int]:
        """(Re)form the process group over every rank, then agree block counts with a MIN all-reduce."""
        with self._group_lock:
            self.generation += 1
            t = self.config.group_timeout_s
            _results([c.leave_group() for c in self.clients])
            first = self.clients[0]
            host = first.node_ip()
            port = first.open_store(host, t)
            _results([c.join_group(host, port, t, self.generation) for c in self.clients])
            counts = _results([c.agree_block_counts(t) for c in self.clients])
            if len(set(counts)) != 1:
                raise ClusterError(f"ranks disagree on block counts after the all-reduce: {counts}")
            self.block_counts = tuple(counts[0])
            logger.info("process group %d formed: %d ranks, %s blocks per tier", self.generation,
                        len(self.clients), self.block_counts)
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

    def arm_crash(self, rank: int, point: CrashPoint, after: int = 1) -> dict[str, int]:
        """Have rank ``rank``'s process crash the ``after``-th time it reaches ``point`` (``faults.CrashPoint``);
        the points armed on it now."""
        return self.client(rank).arm_crash(point, after)

    def migrate(self, tokens: Sequence[int], src: int, dst: int, max_blocks: int | None = None,
                lora_id: int | None = None, cache_salt: str | None = None) -> int:
        return self.migrator.migrate(tokens, src, dst, max_blocks, lora_id, cache_salt).sent_blocks

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
        calls = [c.load_later() for c in self.clients]
        out: list[RankLoad | None] = []
        for call in calls:
            try:
                out.append(call.result())
            except RankDiedError:
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
                             device_blocks=info.device_blocks, host_blocks=info.host_blocks,
                             windows=[{"window": w, "device": d, "host": h} for w, d, h in info.windows])
            ranks.append(entry)
        return {"num_ranks": len(self.clients), "device": self.device, "generation": self.generation,
                "agreed_blocks": None if self.block_counts is None else _agreed(self.block_counts),
                "ranks": ranks, "time": time.time()}


def _agreed(counts: tuple[int, ...]) -> dict:
    """The agreed ``(device, host)`` counts of window 0, then of each further attention window (the ranks' order):
    one window's as they are; several windows' each on its own (``windows``), since each draws on its own pool."""
    pairs = [{"device": d, "host": h} for d, h in zip(counts[::2], counts[1::2])]
    return pairs[0] if len(pairs) == 1 else {"windows": pairs}


def _results(calls: list[PendingCall]) -> list:
    """The results of calls launched together, in order (each waited on within its own timeout)."""
    return [call.result() for call in calls]


class _GroupTransfer:
    """A migration between two rank actors: ``send_prefix`` on the source and ``receive_prefix`` on the target,
    launched together; they negotiate and move the bytes over their process group, one round trip from here."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster

    def __call__(self, tokens: list[int], src: int, dst: int, max_blocks: int | None, lora_id: int | None,
                 cache_salt: str | None) -> MigrationResult:
        c = self.cluster
        source, target = c.client(src), c.client(dst)
        tag = random.randrange(1, 2 ** 31)   # apart from any other coordinator's migration between these ranks
        timeout = c.config.group_timeout_s + 30
        sides = [source.send_prefix(tokens, dst, max_blocks, lora_id, cache_salt, tag, timeout),
                 target.receive_prefix(tokens, src, max_blocks, lora_id, cache_salt, tag, timeout)]
        deadline = time.monotonic() + timeout
        try:
            if not all(side.done(max(0.0, deadline - time.monotonic())) for side in sides):
                raise TimeoutError(f"migration {src} -> {dst} did not end within {timeout:g} s")
            sent, received = (side.result() for side in sides)
        except Exception:
            self._settle(sides, tag, timeout)
            raise self._failure(src, dst, sides) from None
        assert sent.moved_blocks == received.moved_blocks, f"rank {src} sent {sent}, rank {dst} received {received}"
        return MigrationResult(src, dst, sent.matched_blocks, received.moved_blocks, sent.bytes, received.seconds)

    @staticmethod
    def _settle(sides: list[PendingCall], tag: int, timeout_s: float) -> None:
        """After a failure, wait (at most ``timeout_s``) for a side still in the migration to end and undo its
        step: a receive still posted would take the next migration's messages. A side whose peer died fails once
        the channel breaks, at the latest at the group's timeout; a side that died (or is back, restarted, and
        so in no migration) is not waited for."""
        deadline = time.monotonic() + timeout_s
        for side in sides:
            if side.done():
                continue
            try:
                running = side.client.in_transfer(tag)
            except RankDiedError:
                continue
            if running:
                side.done(max(0.0, deadline - time.monotonic()))

    @staticmethod
    def _failure(src: int, dst: int, sides: list[PendingCall]) -> Exception:
        """What a failed migration raises: a dead side's loss says what happened (``RankDiedError``, the rank
        marked down); a failure of the other side (its channel broke) is logged."""
        failed = []
        for side in sides:
            try:
                side.result(timeout_s=1.0)
            except Exception as e:  # each side's failure is looked at below
                failed.append(e)
        assert failed, f"migration {src} -> {dst} failed, but neither side did"
        first = next((e for e in failed if isinstance(e, RankDiedError)), failed[0])
        for e in failed:
            if e is not first:
                logger.warning("migration %d -> %d: the other side failed too: %s", src, dst, e)
        return first
