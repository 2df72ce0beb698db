"""The event codec under fuzz: ten thousand malformed batches, each refused with ``EventDecodeError`` and none
changing the index.

Every case starts from a valid batch (both of vLLM's layouts: map and array events) and breaks it one way that
no decoder may accept: its bytes cut short or followed by more, one field of one event replaced by a value of
no field's type, an unknown event tag, or a batch of the wrong shape. The index is fed the bytes
(``SequencedIndex.ingest``, the router's one event route) and must be exactly as it was.
"""
from __future__ import annotations

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvledger.router.groups import WindowedIndex
from kvledger.router.numbering import SequencedIndex
from kvledger.worker.wire.events import EventDecodeError, decode_batch

T = 4
#: Values no field of any event takes: a map (fields take ints, strings, lists or tier-count maps of ints),
#: negative ints where counts and hashes go (msgpack cannot carry ints beyond u64 at all), NaN, nested lists.
POISON = st.sampled_from([{"poison": [1]}, {"GPU": "many"}, -(2**63), -1, float("nan"), [[1]], [{}]])
#: The fields each event kind carries on the wire, by its array slot (vLLM <= 0.23) or map key (>= 0.24).
STORED_FIELDS = ["block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium"]


def stored(hashes: list[int], tokens: list[int], parent: int | None) -> dict:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
            "block_size": T, "lora_id": None, "medium": "GPU", "lora_name": None, "group_idx": 0,
            "kv_cache_spec_kind": "full_attention"}


def removed(hashes: list[int]) -> dict:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU", "group_idx": 0}


def as_array(ev: dict) -> list:
    """vLLM's old array layout of ``ev``: the tag, then the fields in order (BlockStored's slot 8 is
    ``extra_keys``)."""
    if ev["type"] == "BlockStored":
        return ["BlockStored", *(ev[k] for k in STORED_FIELDS), ev["lora_name"], None, ev["group_idx"],
                ev["kv_cache_spec_kind"]]
    return [ev["type"], ev["block_hashes"], ev["medium"], ev["group_idx"]]


@st.composite
def valid_batches(draw: st.DrawFn) -> tuple[list, bool]:
    n = draw(st.integers(1, 4))
    hashes = draw(st.lists(st.integers(0, 2**64 - 1), min_size=n, max_size=n, unique=True))
    events: list[dict] = [stored(hashes, draw(st.lists(st.integers(0, 511), min_size=n * T, max_size=n * T)),
                                 draw(st.none() | st.integers(0, 2**64 - 1)))]
    if draw(st.booleans()):
        events.append(removed(hashes[:1]))
    array = draw(st.booleans())
    return [draw(st.floats(0, 2e9)), [as_array(e) for e in events] if array else events, 0], array


@st.composite
def malformed(draw: st.DrawFn) -> bytes:
    batch, array = draw(valid_batches())
    data = msgpack.packb(batch)
    decode_batch(data)   # the starting point is valid
    how = draw(st.sampled_from(["cut", "extend", "field", "tag", "shape"]))
    if how == "cut":
        return data[:draw(st.integers(0, len(data) - 1))]
    if how == "extend":
        return data + draw(st.binary(min_size=1, max_size=8))
    events = batch[1]
    i = draw(st.integers(0, len(events) - 1))
    if how == "tag":
        tag = draw(st.sampled_from(["BlockStolen", "", "blockstored", 7]))
        if array:
            events[i][0] = tag
        else:
            events[i]["type"] = tag
        return msgpack.packb(batch)
    if how == "shape":
        return msgpack.packb(draw(st.sampled_from([batch[:1], [*batch, 0, 0], {"ts": batch[0]}, batch[1],
                                                   [batch[0], {"events": events}, 0], [batch[0], events, "r0"]])))
    ev = events[i]
    is_stored = (ev[0] if array else ev["type"]) == "BlockStored"
    names = STORED_FIELDS if is_stored else ["block_hashes", "medium"]
    k = draw(st.integers(0, len(names) - 1))
    value = draw(POISON)
    if array:
        ev[k + 1] = value
    else:
        ev[names[k]] = value
    return msgpack.packb(batch)


@pytest.fixture(scope="module")
def index() -> SequencedIndex:
    ix = SequencedIndex(WindowedIndex(T))
    assert ix.ingest(0, 0, msgpack.packb([1.0, [stored([11, 12], list(range(8)), None)], 0]))[0].applied
    return ix


@settings(max_examples=10_000, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=malformed())
def test_every_malformed_batch_is_refused_and_changes_nothing(index: SequencedIndex, data: bytes) -> None:
    before = (index.num_blocks(), index.next_seq(0), index.store.holders(11), index.store.holders(12))
    with pytest.raises(EventDecodeError):
        index.ingest(0, 1, data)
    assert (index.num_blocks(), index.next_seq(0), index.store.holders(11), index.store.holders(12)) == before
