"""The responses the router relayed, by id: which rank keeps each, and the conversation a follow-up extends.

A vLLM server keeps its stored responses in its own memory
(``VLLM_ENABLE_RESPONSES_API_STORE=1``; without it a ``previous_response_id``
is answered 404), so a request that continues one (``previous_response_id``)
can be served only by the engine that answered it: the router routes it there
whatever the prefix says, and hashes the conversation that engine will render,
from the messages kept here (``router.responses.input_messages``). Bounded:
the oldest are forgotten first; a forgotten or unknown id is answered as vLLM
answers one it does not hold (404).
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass


class UnknownResponseError(LookupError):
    """A ``previous_response_id`` the router relayed no response for (or forgot, or whose engine died)."""


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """One relayed response: where it was made and what a follow-up renders before its own input."""

    rank: int
    messages: list[dict]
    """The chat messages its request was rendered from."""
    output: list[dict]
    """Its output items (the text of its messages joins the conversation)."""


class ResponseStore:
    """Response id -> ``StoredResponse``, the ``capacity`` latest (thread-safe)."""

    def __init__(self, capacity: int) -> None:
        if type(capacity) is not int or capacity < 0:
            raise ValueError(f"capacity must be an int >= 0, got {capacity!r}")
        self.capacity = capacity
        self._kept: OrderedDict[str, StoredResponse] = OrderedDict()
        self._lock = threading.Lock()

    def remember(self, response_id: str, stored: StoredResponse) -> None:
        with self._lock:
            self._kept[response_id] = stored
            self._kept.move_to_end(response_id)
            while len(self._kept) > self.capacity:   # bounded: one more than capacity at most
                self._kept.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse:
        """The stored response; ``UnknownResponseError`` in vLLM's words for one not kept."""
        with self._lock:
            stored = self._kept.get(response_id)
        if stored is None:
            raise UnknownResponseError(f"Response with id '{response_id}' not found.")
        return stored

    def __len__(self) -> int:
        with self._lock:
            return len(self._kept)
