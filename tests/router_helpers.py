"""What the tests of a router over a real local Ray cluster share: prompts of a test's own, bounded waits, and
the check that ranks are left idle and balanced."""
from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator

import httpx

from kvledger.worker.engine.tokenizer import encode

#: Seconds any call to the cluster or the router may take.
TIMEOUT = 60
SYSTEM = "You are a terse assistant. Answer with one word only, please.\n"   # 63 bytes; with "Q" 8 blocks


def system(tag: str) -> str:
    """A system prompt as long as ``SYSTEM`` that is this test's own (``tag`` begins with its own letter)."""
    p = f"{tag}: {SYSTEM}"[:len(SYSTEM) - 1] + "\n"
    assert len(encode(p)) == len(encode(SYSTEM)), p
    return p


def idle(cluster) -> None:
    """Every rank of ``cluster`` (a ``Cluster``) balances its books and holds no running request's block."""
    for r, client in enumerate(cluster.clients):
        client.check_integrity()
        load = client.load()
        assert load.running_requests == load.queued_requests == 0 and load.device_blocks_used == 0, (r, load)


def wait_for(cond, what: str, timeout_s: float = 20.0):
    deadline = time.monotonic() + timeout_s
    while True:
        got = cond()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)   # another process's push: nothing local to wait on


def wait_logged(client: httpx.Client, cond, what: str, rank: int | None = None, timeout_s: float = 20.0):
    """``cond()``, re-checked each time the router logs an event (of ``rank``): an index apply wakes the wait
    (``GET /v1/events`` long-polls), so nothing sleeps. For what arrives by another process's push."""
    deadline = time.monotonic() + timeout_s
    since = client.get("/v1/cluster").json()["router"]["events_logged"]
    while not (got := cond()):
        left = deadline - time.monotonic()
        assert left > 0, f"timed out waiting for {what}"
        params = {"since": since, "limit": 1, "timeout": left, **({} if rank is None else {"rank": rank})}
        lines = [json.loads(x) for x in client.get("/v1/events", params=params, timeout=left + 10).text.splitlines()
                 if x]
        if lines:
            since = lines[-1]["id"] + 1
    return got


#: How long an engine's events may take to reach the index (they arrive within milliseconds here).
INDEX_WAIT_S = 30.0


def wait_indexed(service, rank: int, tokens: list[int], want: int,
                 cache_salt: str | None = None) -> None:
    """Until the index holds ``want`` tokens of ``tokens`` on ``rank`` (bounded), woken by each event the feed
    logs for the rank (they arrive on the subscriber's thread)."""
    deadline = time.monotonic() + INDEX_WAIT_S
    since = service.feed.log.next_id
    while (got := service.probe(tokens, cache_salt=cache_salt)[rank].matched_tokens) < want:
        left = deadline - time.monotonic()
        assert left > 0, f"rank {rank} indexed {got} of {want} tokens after {INDEX_WAIT_S:g} s"
        _, since = service.feed.wait_events(since, rank, 1000, min(left, 1.0))


@contextlib.contextmanager
def over_http(service, timeout_s: float = 120.0) -> Iterator[httpx.Client]:
    """A client of ``service``'s HTTP API on a port of its own (127.0.0.1); the service is closed after it."""
    from kvledger.router.http import HttpServer, make_app

    server = HttpServer(make_app(service), port=0).start()
    try:
        with httpx.Client(base_url=server.url, timeout=timeout_s) as client:
            yield client
    finally:
        server.stop()
        service.close()
