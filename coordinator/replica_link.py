"""How router replicas reach each other: Ray actor calls, by the replicas' names (``ReplicaSync``'s transport)."""
from __future__ import annotations

import ray
from ray.exceptions import RayActorError

from kvledger.router.replica_sync import PeerBatch, PeerGone


class RayPeers:
    """Sends a ``PeerBatch`` to the router actor of that name and waits for its answer."""

    def __init__(self, namespace: str, timeout_s: float) -> None:
        self.namespace = namespace
        self.timeout_s = timeout_s
        self._handles: dict[str, ray.actor.ActorHandle] = {}
        """Found once per peer (each peer's batches come from one thread, so no lock): a restarted actor keeps
        its handle."""

    def send(self, peer: str, batch: PeerBatch) -> int:
        """``PeerGone`` when no actor has that name or its process died (its requests died with it);
        ``GetTimeoutError`` when it did not answer in time."""
        try:
            handle = self._handles.get(peer) or ray.get_actor(peer, namespace=self.namespace)
        except ValueError as e:   # not started yet, or killed for good
            raise PeerGone(str(e)) from e
        self._handles[peer] = handle
        try:
            return ray.get(handle.peer_events.remote(batch), timeout=self.timeout_s)
        except RayActorError as e:   # dead, or restarting (ActorUnavailableError)
            raise PeerGone(str(e)) from e
