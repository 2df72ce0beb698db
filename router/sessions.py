"""Agent sessions: where each one lives, so its next turn finds its prefix and other traffic leaves it alone.

An agent resends its growing conversation every turn, with gaps while a tool
runs. ``Sessions`` keeps, per session id (``session_of``: the ``x-session-id``
header, else ``metadata.session_id``, else ``user``), the rank its last turn
ran on, that turn's prompt (its length, full blocks and the hash of the last,
so a prompt that starts with it is known to extend it), the device blocks
prompt and answer filled there, when it was last seen, its turns, the prompt
and cached tokens delivered to it, and whether it waits on a tool (its last
answer called one: ``waits_on_tool``). The ``kv`` policy reads it as
``SessionAt`` for a session's own turn and as session blocks per rank for
everyone else's (``router.policies.kv``: affinity and protection).

A session idle for ``ttl_s`` (by the injected clock) drops out, lazily, on
the next call: the table is ordered by last seen, so expiry pops from the
front. At most ``max_sessions`` are kept; past it the oldest idle one goes.
Thread-safe.
"""
from __future__ import annotations

import dataclasses
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from kvledger.router.openai_types import ParamError
from kvledger.router.policies import RouteRequest, SessionAt

#: The longest session id taken (a table key; longer ones are refused, naming the field).
MAX_SESSION_ID = 256
#: The ``finish_reason`` of an answer that asks the client to run a tool (chat completions, OpenAI's).
TOOL_CALLS = "tool_calls"
#: The Responses output items that call a tool.
RESPONSE_CALLS = ("function_call", "custom_tool_call")


def session_of(header: str | None, fields: Mapping[str, object], tenant: str | None = None) -> str | None:
    """The request's session id: ``header`` (``x-session-id``), else ``fields["metadata"]["session_id"]``, else
    ``fields["user"]``; namespaced under ``tenant`` (two tenants' ids never meet). ``ParamError`` names a given
    one that is not a string of 1..``MAX_SESSION_ID`` characters."""
    metadata = fields.get("metadata")
    if header is not None:
        sid, param = header, "x-session-id"
    elif isinstance(metadata, Mapping) and metadata.get("session_id") is not None:
        sid, param = metadata["session_id"], "metadata.session_id"
    elif fields.get("user") is not None:
        sid, param = fields["user"], "user"
    else:
        return None
    if not isinstance(sid, str) or not 1 <= len(sid) <= MAX_SESSION_ID:
        raise ParamError(param, f"{param} must be a string of 1..{MAX_SESSION_ID} characters, got {sid!r:.80}")
    return sid if tenant is None else f"tenant:{tenant}/{sid}"


def waits_on_tool(answer: Mapping) -> bool:
    """Whether an answer, or a streamed chunk, calls a tool: a choice with ``finish_reason`` ``tool_calls``, or
    ``tool_calls`` in its message or delta (a named ``tool_choice`` finishes with ``stop``, as OpenAI's does); a
    Responses answer (or its ``response.completed`` event) with a function call among its output items."""
    for c in answer.get("choices") or ():
        if isinstance(c, Mapping) and (c.get("finish_reason") == TOOL_CALLS or any(
                isinstance(m, Mapping) and m.get(TOOL_CALLS) for m in (c.get("message"), c.get("delta")))):
            return True
    response = answer.get("response")
    output = (response if isinstance(response, Mapping) else answer).get("output")
    return isinstance(output, list) and any(isinstance(item, Mapping) and item.get("type") in RESPONSE_CALLS
                                            for item in output)


@dataclass(slots=True)
class Session:
    """One live session as its last turn left it."""

    rank: int
    prompt_tokens: int
    """Its last prompt's length."""
    prompt_blocks: int
    """Full blocks of its last prompt (the router's block size), whose last hash is ``last_hash``."""
    last_hash: int | None
    blocks: int
    """Device blocks its last turn filled on ``rank`` (prompt and answer, the rank's block size)."""
    last_seen: float
    turns: int = 0
    prompt_tokens_total: int = 0
    cached_tokens_total: int = 0
    waiting_on_tool: bool = False


@dataclass(frozen=True, slots=True)
class SessionStats:
    """What ``status`` and ``/metrics`` show: the live sessions, and every session turn's tokens so far."""

    live: int
    waiting_on_tool: int
    turns: int
    prompt_tokens: int
    cached_tokens: int

    @property
    def hit_rate(self) -> float:
        """Cached / prompt tokens over the session turns served."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class Sessions:
    """See the module docstring."""

    def __init__(self, ttl_s: float = 300.0, max_sessions: int = 100_000,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not 0 < ttl_s < float("inf"):
            raise ValueError(f"ttl_s must be a finite number > 0, got {ttl_s!r}")
        if type(max_sessions) is not int or max_sessions < 1:
            raise ValueError(f"max_sessions must be an int >= 1, got {max_sessions!r}")
        self.ttl_s, self.max_sessions, self.clock = ttl_s, max_sessions, clock
        self._table: OrderedDict[str, Session] = OrderedDict()
        """Oldest seen first."""
        self._blocks: dict[int, int] = {}
        """Per rank, the blocks of the live sessions there."""
        self._turns = self._prompt = self._cached = 0
        self._lock = threading.Lock()

    def at(self, session: str, request: RouteRequest) -> SessionAt | None:
        """Where ``session`` lives for its turn ``request`` (``None``: unknown or expired): what its rank held of
        its last prompt counts only if ``request`` starts with that prompt's full blocks."""
        with self._lock:
            s = self._live(session)
            if s is None:
                return None
            k = s.prompt_blocks
            extends = k and len(request.block_hashes) >= k and request.block_hashes[k - 1] == s.last_hash
            return SessionAt(s.rank, k * request.tokens_per_block if extends else 0, s.blocks)

    def blocks_by_rank(self) -> dict[int, int]:
        """Per rank, the device blocks live sessions left there."""
        with self._lock:
            self._expire(self.clock())
            return {r: n for r, n in self._blocks.items() if n}

    def served(self, session: str, rank: int, request: RouteRequest, blocks: int, cached_tokens: int,
               waiting_on_tool: bool) -> None:
        """``session``'s turn ``request`` was served on ``rank``: it filled ``blocks`` device blocks there,
        ``cached_tokens`` of its prompt came from cache, and its answer does or does not wait on a tool."""
        with self._lock:
            now = self.clock()
            old = self._table.pop(session, None)
            if old is not None:
                self._blocks[old.rank] -= old.blocks
            k = len(request.block_hashes)
            s = Session(rank, len(request.tokens), k, request.block_hashes[-1] if k else None, blocks, now)
            if old is not None:
                s.turns, s.prompt_tokens_total, s.cached_tokens_total = (old.turns, old.prompt_tokens_total,
                                                                         old.cached_tokens_total)
            s.turns += 1
            s.prompt_tokens_total += len(request.tokens)
            s.cached_tokens_total += cached_tokens
            s.waiting_on_tool = waiting_on_tool
            self._table[session] = s
            self._blocks[rank] = self._blocks.get(rank, 0) + blocks
            self._turns += 1
            self._prompt += len(request.tokens)
            self._cached += cached_tokens
            self._expire(now)
            while len(self._table) > self.max_sessions:
                self._drop(next(iter(self._table)))

    def forget_rank(self, rank: int) -> None:
        """``rank`` left: the sessions living there hold nothing any more."""
        with self._lock:
            for sid in [sid for sid, s in self._table.items() if s.rank == rank]:
                self._drop(sid)

    def get(self, session: str) -> Session | None:
        """A copy of ``session``'s record (``None``: unknown or expired)."""
        with self._lock:
            s = self._live(session)
            return None if s is None else dataclasses.replace(s)

    def stats(self) -> SessionStats:
        with self._lock:
            self._expire(self.clock())
            waiting = sum(s.waiting_on_tool for s in self._table.values())
            return SessionStats(len(self._table), waiting, self._turns, self._prompt, self._cached)

    def _live(self, session: str) -> Session | None:
        self._expire(self.clock())
        return self._table.get(session)

    def _expire(self, now: float) -> None:
        table = self._table
        while table:   # bounded: each pass drops one
            sid, s = next(iter(table.items()))
            if s.last_seen + self.ttl_s > now:
                return
            self._drop(sid)

    def _drop(self, session: str) -> None:
        s = self._table.pop(session)
        self._blocks[s.rank] -= s.blocks
