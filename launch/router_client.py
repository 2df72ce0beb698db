"""``kvledger route`` and ``kvledger monitor``: clients of the router's HTTP API.

Both find the router at ``--url``, else at the running cluster's replica
``--router-index`` (state file), else at its first replica that answers
``/health`` (any replica serves any request and sees every rank's events), else
at http://127.0.0.1:8000, and send ``--api-key`` (else
``$KVLEDGER_API_KEY``) when the router has keys. ``monitor`` shows a per-rank
table (blocks per tier, hit rate, events/s) refreshed in place with rich, and
the last events of the live stream under it; ``--json`` prints the stream's
raw JSON lines instead.
"""
from __future__ import annotations

import json
import os
import threading
import time
from collections import deque
from collections.abc import Callable

import httpx

from kvledger.router.report import ClusterReport

DEFAULT_URL = "http://127.0.0.1:8000"
API_KEY_ENV = "KVLEDGER_API_KEY"


def auth_headers(api_key: str | None = None) -> dict[str, str]:
    """``Authorization: Bearer`` with ``api_key``, else ``$KVLEDGER_API_KEY``; none when neither is set."""
    key = api_key or os.environ.get(API_KEY_ENV)
    return {"Authorization": f"Bearer {key}"} if key else {}


def router_state(url: str, timeout_s: float = 3.0) -> str:
    """What the router at ``url`` says of itself: ``ready``, ``starting`` (rebuilding its index after a
    restart), ``no live rank``, or ``not answering``."""
    try:
        r = httpx.get(f"{url}/health", headers=auth_headers(), timeout=timeout_s)
    except httpx.HTTPError:
        return "not answering"
    if r.status_code == 200:
        return "ready"
    try:
        code = r.json().get("error", {}).get("code") or r.json().get("status")
    except ValueError:
        code = None
    return "starting" if code == "starting" else "no live rank" if code == "no_live_rank" else f"HTTP {r.status_code}"


def router_url(url: str | None = None, index: int | None = None) -> str:
    """``url``; else the running cluster's replica ``index`` (state file), or its first ready replica (the
    first recorded when none is ready); else the default."""
    if url:
        return url.rstrip("/")
    from kvledger.launch.state import ClusterState

    try:
        state = ClusterState.load()
    except ValueError:
        state = None
    urls = [] if state is None else state.router_urls
    if index is not None:
        if not 0 <= index < len(urls):
            raise ValueError(f"--router-index {index}: the running cluster has {len(urls)} router(s)"
                             + (f", 0..{len(urls) - 1}" if urls else ""))
        return urls[index].rstrip("/")
    ready = next((u for u in urls if router_state(u) == "ready"), None)
    return (ready or (urls[0] if urls else DEFAULT_URL)).rstrip("/")


def _explain(e: httpx.HTTPError, url: str) -> str:
    if isinstance(e, httpx.ConnectError):
        return f"no router answers at {url} ({e}); start one with `kvledger up` or pass --url"
    return f"{type(e).__name__}: {e}"


def route(prompt: str, url: str | None = None, salt: str | None = None, max_tokens: int = 16,
          timeout_s: float = 300.0, model: str | None = None, chat: bool = False, stream: bool = False,
          api_key: str | None = None, router_index: int | None = None, out: Callable[[str], None] = print) -> int:
    """Send one completion (``chat``: as a user message) to the router ``router_url(url, router_index)``;
    print the rank chosen, predicted, cached and computed tokens and the output text (``stream``: as it
    arrives)."""
    try:
        url = router_url(url, router_index)
    except ValueError as e:
        out(f"kvledger route: {e}")
        return 2
    body: dict = {"max_tokens": max_tokens}
    body.update({"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt})
    for k, v in (("cache_salt", salt), ("model", model)):
        if v is not None:
            body[k] = v
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    path = "/v1/chat/completions" if chat else "/v1/completions"
    try:
        with httpx.stream("POST", f"{url}{path}", json=body, headers=auth_headers(api_key), timeout=timeout_s) as r:
            if r.status_code != 200:
                out(f"kvledger route: the router answered {r.status_code}: {r.read().decode()}")
                return 1
            res = _streamed(r, out) if stream else json.loads(r.read())
    except httpx.HTTPError as e:
        out(f"kvledger route: {_explain(e, url)}")
        return 1
    kv = res["kvledger"]
    out(f"rank {kv['rank']}  model {res['model']}  predicted cached {kv['predicted_cached_tokens']}  "
        f"cached {kv['cached_tokens']}  computed {kv.get('computed_tokens', '-')}  "
        f"onboarded {kv.get('onboarded_blocks', '-')} blocks  migrated {kv.get('migrated_blocks', '-')} blocks")
    if not stream:
        choice = res["choices"][0]
        out(f"output: {choice['message']['content'] if chat else choice['text']!r}")
    return 0


def _streamed(r: httpx.Response, out: Callable[[str], None]) -> dict:
    """Print a streamed answer's text as it arrives; return its last (usage) chunk."""
    last: dict = {}
    parts: list[str] = []
    for line in r.iter_lines():
        data = line.removeprefix("data: ").strip()
        if not line.startswith("data: ") or data == "[DONE]":
            continue
        chunk = json.loads(data)
        for c in chunk.get("choices") or ():
            piece = c.get("text") if "text" in c else (c.get("delta") or {}).get("content")
            if piece:
                parts.append(piece)
                out(f"chunk: {piece!r}")
        last = chunk
    out(f"output: {''.join(parts)!r}")
    return last


def _stream(url: str, rank: int | None, since: int, stop: threading.Event,
            on_line: Callable[[str], None], timeout_s: float | None) -> None:
    params: dict = {"since": since}
    if rank is not None:
        params["rank"] = rank
    if timeout_s is not None:
        params["timeout"] = timeout_s
    with httpx.stream("GET", f"{url}/v1/events", params=params, headers=auth_headers(),
                      timeout=httpx.Timeout(10.0, read=None)) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if stop.is_set():
                return
            if line:
                on_line(line)


def _report(url: str) -> ClusterReport:
    """The router's cluster summary, read back into its dataclasses."""
    r = httpx.get(f"{url}/v1/cluster", headers=auth_headers(), timeout=10.0)
    r.raise_for_status()
    return ClusterReport.from_dict(r.json())


def _latest_event_id(url: str) -> int:
    """Where the live stream starts: the number of events the router has logged so far."""
    return _report(url).router.events_logged


def monitor(url: str | None = None, rank: int | None = None, as_json: bool = False, seconds: float | None = None,
            history: int = 12, refresh_s: float = 1.0, router_index: int | None = None,
            out: Callable[[str], None] = print) -> int:
    """Watch the router ``router_url(url, router_index)``: JSON lines (``as_json``) or a live table; stops after
    ``seconds`` or on Ctrl-C."""
    try:
        url = router_url(url, router_index)
    except ValueError as e:
        out(f"kvledger monitor: {e}")
        return 2
    try:
        if as_json:
            _stream(url, rank, 0, threading.Event(), out, seconds)
            return 0
        return _table(url, rank, seconds, history, refresh_s)
    except KeyboardInterrupt:
        return 0
    except httpx.HTTPError as e:
        out(f"kvledger monitor: {_explain(e, url)}")
        return 1


def _table(url: str, rank: int | None, seconds: float | None, history: int, refresh_s: float) -> int:
    from rich.console import Group
    from rich.live import Live
    from rich.table import Table

    recent: deque[dict] = deque(maxlen=history)
    stop = threading.Event()
    since = max(0, _latest_event_id(url) - history)
    reader = threading.Thread(target=_stream, args=(url, rank, since, stop, lambda s: recent.append(json.loads(s)),
                                                    seconds), daemon=True)
    reader.start()

    def render() -> Group:
        c = _report(url)
        ratio = "-" if c.router.delivered_ratio is None else f"{c.router.delivered_ratio:.2f}"
        t = Table(title=f"kvledger router {url}  policy {c.policy}  hit rate {c.router.hit_rate:.0%}  "
                        f"completions {c.router.completions}  cached delivered/predicted {ratio}  "
                        f"events rejected {c.router.events_rejected}")
        for col in ("rank", "GPU used/free", "CPU used/free", "hit rate", "events/s", "events",
                    "index blocks", "in flight", "served", "predicted", "delivered", "rejected"):
            t.add_column(col, justify="right")
        for r in c.ranks:
            if rank is not None and r.rank != rank:
                continue
            gpu = "-" if r.blocks is None else f"{r.blocks['GPU'].used}/{r.blocks['GPU'].free}"
            cpu = "-" if r.blocks is None else f"{r.blocks['CPU'].used}/{r.blocks['CPU'].free}"
            hit = "-" if r.cache_hit_rate is None else f"{r.cache_hit_rate:.0%}"
            name = str(r.rank) if r.engine is None else f"{r.rank} vLLM" + (
                "" if r.data_parallel_rank is None else f" dp{r.data_parallel_rank}")
            t.add_row(name, gpu, cpu, hit,
                      f"{r.events_per_s:.1f}", str(r.events_total), str(r.index_blocks), str(r.inflight_requests),
                      str(r.completions), str(r.predicted_tokens), str(r.cached_tokens), _rejected(r.rejected))
        ev = Table(title="last events")
        for col in ("id", "rank", "batch", "type", "detail"):
            ev.add_column(col)
        for e in list(recent):
            ev.add_row(str(e["id"]), str(e["rank"]), str(e["seq"]), e["type"], _detail(e))
        return Group(t, ev)

    deadline = None if seconds is None else time.monotonic() + seconds
    try:
        with Live(render(), refresh_per_second=4) as live:
            while deadline is None or time.monotonic() < deadline:
                stop.wait(refresh_s if deadline is None else max(0.0, min(refresh_s, deadline - time.monotonic())))
                live.update(render())
    finally:
        stop.set()
    return 0


def _rejected(reasons: dict[str, int]) -> str:
    return ", ".join(f"{n} {reason}" for reason, n in reasons.items()) or "0"


def _detail(e: dict) -> str:
    t = e["type"]
    if t == "BlockStored":
        return f"{len(e['block_hashes'])} block(s) on {e['medium']}, {len(e['token_ids'])} tokens"
    if t == "BlockRemoved":
        return f"{len(e['block_hashes'])} block(s) from {e['medium']}"
    if t == "BlockUpdated":
        return f"{e['old_medium']} -> {e['new_medium']}" if e.get("new_medium") else \
            f"priority {e['old_priority']} -> {e['new_priority']}"
    if t == "KVCacheCreated":   # one per attention window, each its own pool
        window = e.get("kv_cache_spec_sliding_window") or "full"
        return f"{e['num_blocks']}" + (f" in group {e['group_idx']} (window {window})"
                                       if e.get("kv_cache_spec_kind") else "")
    if t == "Snapshot":
        return f"{e['blocks']} blocks, next batch {e['next_seq']}"
    return ""
