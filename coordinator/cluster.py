"""The cluster: rank actors in a placement group, their process group, agreed block counts, serving, health.

``Cluster.start`` spawns one ``RankActor`` per rank (named, in one namespace),
forms the ``torch.distributed`` group (rank 0 opens a TCP store on an
OS-chosen port, every rank joins with the backend ``worker.device`` picks),
and has the ranks all-reduce their block counts with ``MIN`` so every ledger
has the same size. ``Cluster.connect`` finds the actors of a running
(detached) cluster again by name.
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
from kvledger.worker.wire.request import Request
from kvledger.worker.rank.worker import rank_actor_class
from kvledger.worker.wire.errors import RankNotReadyError

logger = logging.getLogger(__name__)


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
    """Handles to the rank actors of one cluster, and what the coordinator does with them."""

    def __init__(self, config: ClusterConfig, actors: list, device: str, placement=None) -> None:
        self.config = config
        self.actors = actors
        self.device = device
        self.placement = placement
        self.block_counts: tuple[int, int] | None = None
        self.generation = 0
        self._group_lock = threading.Lock()
        self._next_rr = 0

    # ------------------------------------------------------------------ lifecycle

    @classmethod
    def start(cls, config: ClusterConfig) -> Cluster:
        """Spawn the rank actors (Ray must be initialised), form the group, agree block counts."""
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
        actor_cls = rank_actor_class()
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
        st = cluster.status()
        live = [r for r in st["ranks"] if r["alive"]]
        if live:
            cluster.device = live[0]["device"].split(":")[0]
            cluster.block_counts = (live[0]["device_blocks"], live[0]["host_blocks"])
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
        self.actors = []

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

    # ------------------------------------------------------------------ serving and probing

    def serve(self, requests: Sequence[dict | Request], rank: int, logits: str = "tensor",
              retry: bool = True) -> list[dict]:
        """Serve a batch on ``rank``; if that rank dies, the batch is retried on another live rank."""
        try:
            return self.get(self.actors[rank].serve.remote(list(requests), logits))
        except (RayActorError, RankNotReadyError):
            if not retry:
                raise
            logger.warning("rank %d is down or restarting; retrying its %d request(s) elsewhere", rank,
                           len(requests))
        for other in self._live_ranks(exclude=rank):
            try:
                return self.get(self.actors[other].serve.remote(list(requests), logits))
            except (RayActorError, RankNotReadyError):
                continue
        raise ClusterError(f"no live rank could serve request(s) {[getattr(r, 'request_id', r) for r in requests]}")

    def probe(self, tokens: Sequence[int], lora_id: int | None = None, cache_salt: str | None = None) -> list[int]:
        """Exact probe of every rank: matched tokens per rank (-1 for a rank that does not answer)."""
        refs = [a.probe.remote(list(tokens), lora_id, cache_salt) for a in self.actors]
        out = []
        for ref in refs:
            try:
                out.append(self.get(ref))
            except (RayActorError, GetTimeoutError, RankNotReadyError):
                out.append(-1)
        return out

    def best_rank(self, tokens: Sequence[int]) -> tuple[int, list[int]]:
        """The rank holding the longest prefix; ties go round-robin. Stands in until the router lands."""
        matched = self.probe(tokens)
        best = max(matched)
        tied = [r for r, m in enumerate(matched) if m == best and m >= 0]
        choice = tied[self._next_rr % len(tied)]
        self._next_rr += 1
        return choice, matched

    def _live_ranks(self, exclude: int | None = None) -> list[int]:
        """Ranks that answer and have a ledger."""
        live = []
        for r, a in enumerate(self.actors):
            if r == exclude:
                continue
            try:
                if self.get(a.load.remote(), timeout=10)["ready"]:
                    live.append(r)
            except (RayActorError, GetTimeoutError):
                pass
        return live

    # ------------------------------------------------------------------ health

    def alive(self) -> list[bool]:
        """Whether each rank answers a ping now (a restarting rank does not)."""
        refs = [a.ping.remote() for a in self.actors]
        out = []
        for ref in refs:
            try:
                self.get(ref, timeout=10)
                out.append(True)
            except (RayActorError, GetTimeoutError):
                out.append(False)
        return out

    def heal(self, timeout_s: float = 90.0, poll_s: float = 0.5) -> list[int]:
        """Wait until every rank is back (Ray restarts dead ones), then re-form the group if any had restarted.

        A restarted rank comes back with no ledger; re-forming the group includes
        it and agrees block counts again (the survivors keep their ledgers, and
        their caches, when the agreed counts are unchanged). Returns the ranks
        that had restarted; raises ``ClusterError`` when one is not back in time.
        """
        deadline = time.monotonic() + timeout_s
        restarted: list[int] = []
        for r, a in enumerate(self.actors):
            while True:
                try:
                    load = self.get(a.load.remote(), timeout=max(1.0, deadline - time.monotonic()))
                    break
                except (RayActorError, GetTimeoutError):
                    if time.monotonic() >= deadline:
                        raise ClusterError(f"rank {r} did not come back within {timeout_s:g} s") from None
                    time.sleep(poll_s)  # the actor is restarting; Ray reports no event to wait on
            if not load["ready"]:
                restarted.append(r)
        if restarted:
            logger.warning("rank(s) %s restarted: re-forming the process group", restarted)
            self.form_group()
        return restarted

    # ------------------------------------------------------------------ reports

    def status(self) -> dict:
        """Ranks, device, agreed block counts per tier, blocks in use, whether each rank is alive."""
        refs = [a.load.remote() for a in self.actors]
        stat_refs = [a.stats.remote() for a in self.actors]
        ranks = []
        for r, (ref, sref) in enumerate(zip(refs, stat_refs)):
            try:
                load = self.get(ref, timeout=15)
                st = self.get(sref, timeout=15) if load.get("ready") else None
            except (RayActorError, GetTimeoutError) as e:
                ranks.append({"rank": r, "alive": False, "error": type(e).__name__})
                continue
            entry = {"rank": r, "alive": True, **load}
            if st is not None:
                entry.update(device=st["device"], backend=st["backend"], in_group=st["in_group"],
                             device_blocks=st["max_num_blocks"], host_blocks=st["max_num_secondary_blocks"],
                             cache_hit_rate=st["cache_hit_rate"])
            ranks.append(entry)
        return {"num_ranks": len(self.actors), "device": self.device, "generation": self.generation,
                "agreed_blocks": None if self.block_counts is None else
                {"device": self.block_counts[0], "host": self.block_counts[1]},
                "ranks": ranks, "time": time.time()}
