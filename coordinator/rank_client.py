"""``RankClient`` over one rank actor: each method one actor call, waited on with a timeout.

Besides the router's ``RankClient`` methods it has the coordinator's: the
process group, crash arming, the router's event pushes and the two sides of a
migration. The calls every rank must be in at once (the group's rendezvous and
all-reduce, the two sides of a migration) and those asked of every rank
together (load, for a health round) return a ``PendingCall``: launched now,
waited on when the caller has launched the others. Nothing outside this module
calls the actor.

A dead actor (``RayActorError``), one that does not answer in time, and one
that restarted and has no ledger yet (``RankNotReadyError``) all become
``RankDiedError``, and the cluster is told (``on_lost``) so it stops listing
the rank. An error the rank raised for bad input comes back as itself (the
cause, not Ray's wrapper), so callers answer it as such.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from kvledger.router.rank_client import RankDiedError
from kvledger.worker.wire.batches import PublishedBatch, Snapshot
from kvledger.worker.wire.errors import RankNotReadyError
from kvledger.worker.wire.messages import ExportTicket, ImportTicket, RankInfo, RankLoad, ServeReply
from kvledger.worker.wire.request import Request

if TYPE_CHECKING:
    from kvledger.worker.rank.faults import CrashPoint, TransportFaults
    from kvledger.worker.rank.transfer import PrefixMoved

T = TypeVar("T")


@dataclass(frozen=True)
class PendingCall(Generic[T]):
    """One call in flight on a rank actor, waited on as its client waits (same timeouts, same errors)."""

    client: RayRankClient
    ref: ray.ObjectRef
    what: str
    timeout_s: float

    def result(self, timeout_s: float | None = None) -> T:
        """The call's result, within ``timeout_s`` (default: the call's own); errors as ``RayRankClient.wait``."""
        return self.client.wait(self.ref, self.what, self.timeout_s if timeout_s is None else timeout_s)

    def done(self, timeout_s: float = 0.0) -> bool:
        """Whether the call has ended (answered or failed), waiting at most ``timeout_s`` for it."""
        return bool(ray.wait([self.ref], timeout=timeout_s)[0])


class RayRankClient:
    """One rank actor as a ``RankClient`` (see the module docstring)."""

    def __init__(self, rank: int, actor: ray.actor.ActorHandle, quick_timeout_s: float, long_timeout_s: float,
                 on_lost: Callable[[int], None]) -> None:
        self._rank = rank
        self.actor = actor
        self.quick_timeout_s = quick_timeout_s
        self.long_timeout_s = long_timeout_s
        self._on_lost = on_lost

    @property
    def rank(self) -> int:
        return self._rank

    def wait(self, ref: ray.ObjectRef, what: str, timeout_s: float | None = None) -> T:
        """The result of the call ``ref`` (named ``what`` in errors), converting how a rank is lost."""
        try:
            return ray.get(ref, timeout=self.quick_timeout_s if timeout_s is None else timeout_s)
        except RayActorError as e:
            self._on_lost(self._rank)
            raise RankDiedError(self._rank, f"its actor died ({type(e).__name__})") from e
        except GetTimeoutError as e:
            ray.cancel(ref)
            self._on_lost(self._rank)
            raise RankDiedError(self._rank, f"{what} did not answer within the timeout") from e
        except RayTaskError as e:
            cause = e.cause
            if isinstance(cause, RankNotReadyError):
                self._on_lost(self._rank)
                raise RankDiedError(self._rank, str(cause)) from e
            if isinstance(cause, Exception):
                raise cause from None
            raise

    def serve(self, requests: Sequence[Request], logits: bool = False, publish: bool = False) -> ServeReply:
        return self.wait(self.actor.serve.remote(list(requests), logits, publish), "serve", self.long_timeout_s)

    def probe(self, tokens: Sequence[int], lora_id: int | None = None, cache_salt: str | None = None) -> int:
        return self.wait(self.actor.probe.remote(list(tokens), lora_id, cache_salt), "probe")

    def load(self) -> RankLoad:
        return self.wait(self.actor.load.remote(), "load")

    def info(self) -> RankInfo:
        return self.wait(self.actor.info.remote(), "info")

    def poll_events(self) -> PublishedBatch | None:
        return self.wait(self.actor.poll_events.remote(), "poll_events")

    def replay_events(self, from_seq: int) -> list[PublishedBatch] | None:
        return self.wait(self.actor.replay_events.remote(from_seq), "replay_events")

    def event_snapshot(self) -> tuple[PublishedBatch | None, Snapshot]:
        return self.wait(self.actor.event_snapshot.remote(), "event_snapshot", self.long_timeout_s)

    def export_begin(self, tokens: Sequence[int], max_blocks: int | None = None, lora_id: int | None = None,
                     cache_salt: str | None = None) -> ExportTicket:
        return self.wait(self.actor.export_begin.remote(list(tokens), max_blocks, lora_id, cache_salt),
                         "export_begin")

    def export_end(self, pin_id: int) -> None:
        self.wait(self.actor.export_end.remote(pin_id), "export_end")

    def import_begin(self, tokens: Sequence[int], num_blocks: int, lora_id: int | None = None,
                     cache_salt: str | None = None) -> ImportTicket:
        return self.wait(self.actor.import_begin.remote(list(tokens), num_blocks, lora_id, cache_salt),
                         "import_begin")

    def import_abort(self, import_id: int) -> None:
        self.wait(self.actor.import_abort.remote(import_id), "import_abort")

    def check_integrity(self) -> None:
        self.wait(self.actor.check_integrity.remote(), "check_integrity", self.long_timeout_s)

    # ------------------------------------------------------------------ the coordinator's

    def _launch(self, ref: ray.ObjectRef, what: str, timeout_s: float | None = None) -> PendingCall:
        return PendingCall(self, ref, what, self.quick_timeout_s if timeout_s is None else timeout_s)

    def load_later(self) -> PendingCall[RankLoad]:
        """``load``, launched now (a health round asks every rank at once)."""
        return self._launch(self.actor.load.remote(), "load")

    def node_ip(self) -> str:
        return self.wait(self.actor.node_ip.remote(), "node_ip", self.long_timeout_s)

    def open_store(self, host: str, timeout_s: float) -> int:
        """Rank 0: open the group's rendezvous store on ``host``; its port."""
        return self.wait(self.actor.open_store.remote(host, timeout_s), "open_store", self.long_timeout_s)

    def leave_group(self) -> PendingCall[None]:
        return self._launch(self.actor.leave_group.remote(), "leave_group", self.long_timeout_s)

    def join_group(self, host: str, port: int, timeout_s: float, generation: int) -> PendingCall[str]:
        """Join the group at ``host:port`` (a rendezvous: every rank is launched before any is waited on)."""
        return self._launch(self.actor.join_group.remote(host, port, timeout_s, generation), "join_group",
                            timeout_s + 30)

    def agree_block_counts(self, timeout_s: float) -> PendingCall[tuple[int, ...]]:
        """The MIN all-reduce of the block counts over the group (every rank at once), then the ledger."""
        return self._launch(self.actor.agree_block_counts.remote(), "agree_block_counts", timeout_s + 30)

    def arm_crash(self, point: CrashPoint, after: int = 1) -> dict[str, int]:
        return self.wait(self.actor.arm_crash.remote(point, after), "arm_crash")

    def attach_router(self, router: ray.actor.ActorHandle, owner: str, interval_s: float,
                      faults: TransportFaults | None) -> bool:
        """Have the rank push its event batches to ``router``, known to it as ``owner`` (see ``EventPusher``)."""
        return self.wait(self.actor.attach_router.remote(router, owner, interval_s, faults), "attach_router")

    def send_prefix(self, tokens: Sequence[int], dst: int, max_blocks: int | None, lora_id: int | None,
                    cache_salt: str | None, tag: int, timeout_s: float) -> PendingCall[PrefixMoved]:
        """The source side of migration ``tag`` to rank ``dst``, which runs ``receive_prefix`` at the same time."""
        return self._launch(self.actor.send_prefix.remote(list(tokens), dst, max_blocks, lora_id, cache_salt, tag),
                            "send_prefix", timeout_s)

    def receive_prefix(self, tokens: Sequence[int], src: int, max_blocks: int | None, lora_id: int | None,
                       cache_salt: str | None, tag: int, timeout_s: float) -> PendingCall[PrefixMoved]:
        """The target side of migration ``tag`` from rank ``src``."""
        return self._launch(self.actor.receive_prefix.remote(list(tokens), src, max_blocks, lora_id, cache_salt,
                                                             tag), "receive_prefix", timeout_s)

    def in_transfer(self, tag: int) -> bool:
        """Whether the rank is still in migration ``tag``."""
        return self.wait(self.actor.in_transfer.remote(tag), "in_transfer")
