"""``RankClient`` over one rank actor: each method one actor call, waited on with a timeout.

A dead actor (``RayActorError``), one that does not answer in time, and one
that restarted and has no ledger yet (``RankNotReadyError``) all become
``RankDiedError``, and the cluster is told (``on_lost``) so it stops listing
the rank. An error the rank raised for bad input comes back as itself (the
cause, not Ray's wrapper), so callers answer it as such.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from kvledger.router.rank_client import RankDiedError
from kvledger.worker.wire.batches import PublishedBatch, Snapshot
from kvledger.worker.wire.errors import RankNotReadyError
from kvledger.worker.wire.messages import ExportTicket, ImportTicket, RankInfo, RankLoad, ServeReply
from kvledger.worker.wire.request import Request

T = TypeVar("T")


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
