"""The block-event codec: round trips, vLLM's two wire layouts, and clean rejection of malformed bytes."""
from __future__ import annotations

import dataclasses
import math
import re
import struct
from typing import Annotated

import msgpack
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvledger.worker.wire import events as events_module
from kvledger.worker.wire.int_arrays import all_non_negative_int_arrays
from kvledger.worker.wire.events import (EVENT_CLASS, AllBlocksCleared, BlockRemoved, BlockStored, BlockUpdated,
                                         EventBatch, EventDecodeError, KVCacheCreated, KVEvent, decode_batch,
                                         decode_view, encode_batch)

U64_MAX = 2**64 - 1
H1, H2 = 0x18191A1B1C1D1E1F, 0x38393A3B3C3D3E3F

# The vectors: the same batch as vLLM 0.33 (map events) and vLLM <= 0.23 (array events) write it.
VLLM_MAP = bytes.fromhex(
    "93cb41d954fc4020000093de000aa474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657392cf18191a1b1c1d"
    "1e1fcf38393a3b3c3d3e3fb1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f696473980102030405060708aa626c"
    "6f636b5f73697a6504a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c0a967726f75705f69647800b2"
    "6b765f63616368655f737065635f6b696e64ae66756c6c5f617474656e74696f6e84a474797065ac426c6f636b52656d6f766564"
    "ac626c6f636b5f68617368657391cf18191a1b1c1d1e1fa66d656469756da3475055a967726f75705f6964780081a474797065b0"
    "416c6c426c6f636b73436c656172656400"
)
VLLM_ARRAY = bytes.fromhex(
    "93cb41d954fc40200000939cab426c6f636b53746f72656492cf18191a1b1c1d1e1fcf38393a3b3c3d3e3fc09801020304050607"
    "0804c0a3475055c0c000ae66756c6c5f617474656e74696f6ec094ac426c6f636b52656d6f76656491cf18191a1b1c1d1e1fa347"
    "50550091b0416c6c426c6f636b73436c656172656400"
)


#: Where vLLM's array BlockStored carries the fields past ``lora_name`` (it has no cache_salt or priority).
VLLM_STORED_SLOTS = {"extra_keys": 8, "group_idx": 9, "kv_cache_spec_kind": 10, "kv_cache_spec_sliding_window": 11}


def make_stored(**kw: object) -> BlockStored:
    """A small valid BlockStored; keywords override fields."""
    base: dict[str, object] = dict(block_hashes=[H1, H2], parent_block_hash=None,
                                   token_ids=list(range(1, 9)), block_size=4)
    return BlockStored(**{**base, **kw})  # type: ignore[arg-type]


EDGE_EVENTS: list[KVEvent] = [
    make_stored(),
    make_stored(block_hashes=[0, U64_MAX], parent_block_hash=U64_MAX, lora_id=3, medium="CPU",
                lora_name="adapter-a", cache_salt="salt", priority=100, group_idx=2,
                kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=512),
    make_stored(block_hashes=[], token_ids=[], parent_block_hash=0, medium=None, priority=0),
    BlockRemoved(block_hashes=[0, U64_MAX]),
    BlockRemoved(block_hashes=[H1], medium="CPU", group_idx=1),
    BlockRemoved(block_hashes=[], medium=None),
    AllBlocksCleared(),
    KVCacheCreated(num_blocks={"GPU": 1024, "CPU": 0}, block_size=16),
    KVCacheCreated(num_blocks={}, block_size=1),
    BlockUpdated(block_hash=U64_MAX, old_medium="GPU", new_medium="CPU"),
    BlockUpdated(block_hash=0, old_priority=35, new_priority=90),
    BlockUpdated(block_hash=H1),
    BlockUpdated(block_hash=H2, old_medium="CPU", new_medium="GPU", group_idx=1),
]

EXPECTED_VLLM = EventBatch(
    ts=1700000000.5,
    events=[make_stored(kv_cache_spec_kind="full_attention"), BlockRemoved([H1], "GPU"), AllBlocksCleared()],
    rank=0,
)


def wire(obj: object) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def event_maps(batch: EventBatch) -> list[dict[str, object]]:
    """The batch's events as the plain maps our encoder writes, ready to be corrupted."""
    return msgpack.unpackb(encode_batch(batch), raw=False)[1]


def vllm_array(e: KVEvent) -> list[object]:
    """``e`` in vLLM's array layout (our own kinds: fields in declaration order after the tag)."""
    if isinstance(e, BlockStored):
        return ["BlockStored", e.block_hashes, e.parent_block_hash, e.token_ids, e.block_size, e.lora_id,
                e.medium, e.lora_name, e.extra_keys, e.group_idx, e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window]
    return [type(e).__name__, *(getattr(e, f.name) for f in dataclasses.fields(e))]


def rejects(data: bytes) -> str:
    """Assert ``data`` is rejected with EventDecodeError alone; return the message."""
    with pytest.raises(EventDecodeError) as info:
        decode_batch(data)
    return str(info.value)


# --- valid input --------------------------------------------------------------------------------------


@pytest.mark.parametrize("event", EDGE_EVENTS, ids=lambda e: type(e).__name__)
def test_every_kind_round_trips(event: KVEvent) -> None:
    batch = EventBatch(ts=12.25, events=[event], rank=3)
    assert decode_batch(encode_batch(batch)) == batch


def test_batch_of_all_kinds_round_trips_and_rank_none() -> None:
    batch = EventBatch(ts=0.0, events=list(EDGE_EVENTS), rank=None)
    assert decode_batch(encode_batch(batch)) == batch
    assert decode_batch(encode_batch(EventBatch(ts=1.0))) == EventBatch(ts=1.0, events=[], rank=None)


@pytest.mark.parametrize("data", [VLLM_MAP, VLLM_ARRAY], ids=["map-vllm-0.33", "array-vllm-0.23"])
def test_vllm_vectors_decode_exactly(data: bytes) -> None:
    batch = decode_batch(data)
    assert batch == EXPECTED_VLLM
    assert (batch.ts, batch.rank, len(batch.events)) == (1700000000.5, 0, 3)
    stored, removed, cleared = batch.events
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == [H1, H2] and stored.parent_block_hash is None
    assert stored.token_ids == [1, 2, 3, 4, 5, 6, 7, 8] and stored.block_size == 4
    assert (stored.lora_id, stored.medium, stored.lora_name) == (None, "GPU", None)
    assert (stored.cache_salt, stored.priority) == (None, None)
    assert (stored.group_idx, stored.kv_cache_spec_kind) == (0, "full_attention")
    assert isinstance(removed, BlockRemoved)
    assert (removed.block_hashes, removed.medium, removed.group_idx) == ([H1], "GPU", 0)
    assert isinstance(cleared, AllBlocksCleared)


def test_encoded_events_lead_with_type_then_fields_in_declaration_order() -> None:
    ts, events, rank = msgpack.unpackb(encode_batch(EventBatch(2.5, list(EDGE_EVENTS), 1)), raw=False)
    assert (ts, rank) == (2.5, 1)
    for raw, event in zip(events, EDGE_EVENTS):
        assert list(raw) == ["type", *(f.name for f in dataclasses.fields(event))]
        assert raw["type"] == type(event).__name__
    assert list(events[0])[:8] == ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size",
                                   "lora_id", "medium", "lora_name"]


def test_array_layout_of_every_kind_decodes() -> None:
    # vLLM's array BlockStored has no cache_salt or priority: they come back as their defaults.
    expected = [dataclasses.replace(e, cache_salt=None, priority=None) if isinstance(e, BlockStored) else e
                for e in EDGE_EVENTS]
    decoded = decode_batch(wire([5.0, [vllm_array(e) for e in EDGE_EVENTS], 2]))
    assert decoded == EventBatch(ts=5.0, events=expected, rank=2)


def test_optional_fields_may_be_absent_and_unknown_ones_are_ignored() -> None:
    events = [
        {"type": "BlockStored", "block_hashes": [H1], "parent_block_hash": H2, "token_ids": [7] * 4,
         "block_size": 4, "extra_keys": None, "future_field": {"x": [1]}},
        {"block_hashes": [H1], "type": "BlockRemoved"},
        ["BlockStored", [H1], None, [7] * 4, 4],
        ["BlockRemoved", [H1], "CPU", 1, "later-field"],
        ["AllBlocksCleared", "later-field"],
    ]
    assert decode_batch(wire([3, events])) == EventBatch(3.0, [
        make_stored(block_hashes=[H1], parent_block_hash=H2, token_ids=[7] * 4),
        BlockRemoved([H1]),
        make_stored(block_hashes=[H1], token_ids=[7] * 4),
        BlockRemoved([H1], "CPU", 1),
        AllBlocksCleared(),
    ], None)


def test_bytes_hashes_take_their_first_eight_bytes_big_endian() -> None:
    digest = bytes(range(1, 33))  # a sha256-sized hash, as vLLM sends without int hashes
    raw = {"type": "BlockStored", "block_hashes": [digest, b"\x01\x02"], "parent_block_hash": b"\xff" * 8,
           "token_ids": [], "block_size": 16}
    (stored,) = decode_batch(wire([1.0, [raw], 0])).events
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == [0x0102030405060708, 0x0102]
    assert stored.parent_block_hash == U64_MAX


# --- malformed input ----------------------------------------------------------------------------------


def test_every_truncation_and_trailing_bytes_are_rejected() -> None:
    ours = encode_batch(EventBatch(7.0, list(EDGE_EVENTS), 0))
    count = 0
    for data in (VLLM_MAP, VLLM_ARRAY, ours):
        for n in range(len(data)):
            rejects(data[:n])
            count += 1
        assert "ExtraData" in rejects(data + b"\xc0")
    assert count > 600


BAD_BY_FIELD: dict[str, list[object]] = {
    "block_hashes": [None, 1, "ab", {}, [-1], [True], [1.5], ["h"], [None], [b""], [[1]], [-(2**63)]],
    "parent_block_hash": [-1, True, False, 1.5, "h", b"", [], -(2**63)],
    "token_ids": [None, 3, "abc", [-1], [True], [1.0], [None], ["a"], [b"x"], [[1]]],
    "block_size": [-4, True, 4.0, "4", None, [4]],   # 0 is vLLM's offloading naming hashes only
    "lora_id": [-1, True, 1.5, "1", [1]],
    "medium": ["gpu", "", "HBM", 1, True, b"GPU", ["GPU"]],
    "lora_name": [1, True, b"name", ["n"]],
    "cache_salt": [1, False, b"salt", {}],
    "priority": [-1, 101, True, 1.5, "1"],
    "group_idx": [-1, True, None, 1.5, "0"],
    "kv_cache_spec_kind": [1, True, b"full", []],
    "kv_cache_spec_sliding_window": [0, -1, True, 1.5, "512", []],
    "extra_keys": [1, "salt", {}, [1], ["salt"], [{}]],
    "num_blocks": [None, [], 5, {"GPU": -1}, {"GPU": True}, {"GPU": 1.5}, {"GPU": None}, {b"GPU": 1}],
    "block_hash": [None, -1, True, 1.5, "h", b"", [H1]],
    "old_medium": ["cpu", 0, True],
    "new_medium": ["disk", 0, False],
    "old_priority": [-1, 101, True, 2.0],
    "new_priority": [-5, 1000, False, "9"],
}

TEMPLATES: list[KVEvent] = [EDGE_EVENTS[1], EDGE_EVENTS[4], EDGE_EVENTS[7], EDGE_EVENTS[9]]
# vLLM's array BlockStored carries no cache_salt or priority, so those are corrupted in maps only.
NOT_IN_ARRAY = {"cache_salt", "priority"}


def corrupted(template: KVEvent, name: str, bad: object, layout: str) -> bytes:
    """A batch [good, template with field ``name`` set to ``bad``, good] in the given layout."""
    good = make_stored()
    if layout == "map":
        good_raw, raw = event_maps(EventBatch(0.0, [good, template]))
        raw[name] = bad
    else:
        good_raw, raw = vllm_array(good), vllm_array(template)
        slot = 1 + [f.name for f in dataclasses.fields(template)].index(name)
        if isinstance(template, BlockStored):
            slot = VLLM_STORED_SLOTS.get(name, slot)
        raw[slot] = bad
    return wire([1.0, [good_raw, raw, good_raw], 0])


CORRUPTIONS = [
    (type(t).__name__, f.name, bad, layout)
    for t in TEMPLATES for f in dataclasses.fields(t) for bad in BAD_BY_FIELD[f.name]
    for layout in ("map", "array") if not (layout == "array" and f.name in NOT_IN_ARRAY)
]


def test_corruptions_cover_every_field_of_every_kind() -> None:
    covered = {(kind, name) for kind, name, _, _ in CORRUPTIONS}
    for t in TEMPLATES:
        assert {(type(t).__name__, f.name) for f in dataclasses.fields(t)} <= covered
    assert len(CORRUPTIONS) > 200


@pytest.mark.parametrize(("kind", "name", "bad", "layout"), CORRUPTIONS)
def test_one_bad_field_rejects_the_whole_batch_naming_it(kind: str, name: str, bad: object, layout: str) -> None:
    template = next(t for t in TEMPLATES if type(t).__name__ == kind)
    message = rejects(corrupted(template, name, bad, layout))
    assert re.match(rf"events\[1\]: {kind}\.{name}(\[\d+\])?: expected ", message), message


@pytest.mark.parametrize("event", TEMPLATES + [EDGE_EVENTS[0]], ids=lambda e: type(e).__name__)
def test_missing_required_field_is_rejected(event: KVEvent) -> None:
    required = [f.name for f in dataclasses.fields(event) if f.default is dataclasses.MISSING]
    assert required
    for name in required:
        (raw,) = event_maps(EventBatch(0.0, [event]))
        del raw[name]
        assert "required field missing" in rejects(wire([0.0, [raw], 0]))
    short = vllm_array(event)[:len(required)]  # the tag plus all but the last required field
    assert "required field missing" in rejects(wire([0.0, [short], 0]))


@pytest.mark.parametrize("batch", [
    None, 1, "batch", {}, [], [1.0], [1.0, [], 0, "extra"], {"ts": 1.0, "events": []},
    [True, [], 0], ["1.0", [], 0], [None, [], 0], [math.nan, [], 0], [math.inf, [], 0], [[], [], 0],
    [1.0, [], -1], [1.0, [], True], [1.0, [], "0"], [1.0, [], 1.5], [1.0, [], []],
    [1.0, None, 0], [1.0, {}, 0], [1.0, "events", 0], [1.0, b"", 0],
    [1.0, [None], 0], [1.0, [1], 0], [1.0, ["BlockStored"], 0], [1.0, [[]], 0], [1.0, [b"x"], 0],
    [1.0, [{}], 0], [1.0, [{"type": "BlockFoo"}], 0], [1.0, [{"type": 1}], 0], [1.0, [{"type": None}], 0],
    [1.0, [{"type": b"AllBlocksCleared"}], 0], [1.0, [["BlockFoo", [1]]], 0], [1.0, [[1, [1]]], 0],
    [1.0, [[True]], 0], [1.0, [{"Type": "AllBlocksCleared"}], 0],
], ids=repr)
def test_wrong_batch_and_event_shapes_are_rejected(batch: object) -> None:
    rejects(wire(batch))


@pytest.mark.parametrize("data", [
    b"", b"\xc1", b"\x93", b"\xd9\x05ab", b"\x92\xa1\xff\x90",  # truncated, reserved byte, bad utf-8
    msgpack.packb({1: 2}), msgpack.packb([1.0, [], msgpack.ExtType(5, b"x")]),
    msgpack.packb([msgpack.Timestamp(1, 0), [], 0], datetime=False),
    b"\x91" * 5000,  # nested deeper than msgpack's stack
    b"\xdd\xff\xff\xff\xff",  # array header promising 2**32 - 1 items
], ids=repr)
def test_bytes_that_are_not_one_msgpack_batch_are_rejected(data: bytes) -> None:
    rejects(data)


def test_decode_rejects_non_bytes_and_msgpack_cannot_carry_oversized_hashes() -> None:
    with pytest.raises(EventDecodeError):
        decode_batch("not bytes")  # type: ignore[arg-type]
    with pytest.raises(OverflowError):
        wire([2**64])
    assert "block_hashes" in rejects(wire([0.0, [{**event_maps(EventBatch(0.0, [make_stored()]))[0],
                                                  "block_hashes": [float(2**64)]}], 0]))


# --- generated ----------------------------------------------------------------------------------------

hashes = st.integers(0, U64_MAX)
media = st.sampled_from(["GPU", "CPU", None])
priorities = st.none() | st.integers(0, 100)
small = st.integers(0, 2**31)
stored_events = st.builds(
    BlockStored, block_hashes=st.lists(hashes, max_size=8), parent_block_hash=st.none() | hashes,
    token_ids=st.lists(st.integers(0, 2**32), max_size=32), block_size=st.integers(1, 2**20),
    lora_id=st.none() | small, medium=media, lora_name=st.none() | st.text(max_size=8),
    cache_salt=st.none() | st.text(max_size=8), priority=priorities, group_idx=small,
    kv_cache_spec_kind=st.none() | st.text(max_size=8))
any_events: st.SearchStrategy[KVEvent] = st.one_of(
    stored_events,
    st.builds(BlockRemoved, block_hashes=st.lists(hashes, max_size=8), medium=media, group_idx=small),
    st.just(AllBlocksCleared()),
    st.builds(KVCacheCreated, num_blocks=st.dictionaries(st.text(max_size=4), st.integers(0, 2**40), max_size=3),
              block_size=st.integers(1, 2**20)),
    st.builds(BlockUpdated, block_hash=hashes, old_medium=media, new_medium=media,
              old_priority=priorities, new_priority=priorities),
)
batches = st.builds(EventBatch, ts=st.floats(allow_nan=False, allow_infinity=False),
                    events=st.lists(any_events, max_size=6), rank=st.none() | small)
FAST = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FAST
@given(batches)
def test_generated_batches_round_trip(batch: EventBatch) -> None:
    decoded = decode_batch(encode_batch(batch))
    assert decoded == batch and decoded.events == batch.events
    assert_round_trips(decoded)


@FAST
@given(st.data(), st.lists(any_events, min_size=1, max_size=5), st.sampled_from(["map", "array"]))
def test_generated_bad_field_anywhere_rejects_the_batch(data: st.DataObject, events: list[KVEvent],
                                                        layout: str) -> None:
    candidates = [(i, f.name) for i, e in enumerate(events) for f in dataclasses.fields(e)
                  if not (layout == "array" and isinstance(e, BlockStored) and f.name in NOT_IN_ARRAY)]
    i, name = data.draw(st.sampled_from(candidates)) if candidates else (0, "")
    raws: list[object] = (event_maps(EventBatch(0.0, events)) if layout == "map"
                          else [vllm_array(e) for e in events])
    # uncorrupted, the same raws decode to the events (vLLM's array BlockStored has no cache_salt or priority)
    expected = events if layout == "map" else [
        dataclasses.replace(e, cache_salt=None, priority=None) if isinstance(e, BlockStored) else e for e in events]
    intact = decode_batch(wire([1.0, raws, 0]))
    assert intact.events == expected
    assert_round_trips(intact)
    if not name:  # only AllBlocksCleared: corrupt its tag instead
        raws[0] = data.draw(st.sampled_from([{"type": "AllBlocksclear"}, ["AllBlocks"], [None], {}]))
    else:
        bad = data.draw(st.sampled_from(BAD_BY_FIELD[name]))
        raw = raws[i]
        if isinstance(raw, dict):
            raw[name] = bad
        else:
            assert isinstance(raw, list)
            names = [f.name for f in dataclasses.fields(events[i])]
            slot = 1 + names.index(name)
            if isinstance(events[i], BlockStored):
                slot = VLLM_STORED_SLOTS.get(name, slot)
            raw[slot] = bad
    assert rejects(wire([1.0, raws, 0])).startswith(f"events[{i}]:")


def assert_round_trips(decoded: EventBatch) -> None:
    """What decodes encodes back to bytes that decode to the same batch, and to the same events."""
    assert isinstance(decoded, EventBatch)
    again = decode_batch(encode_batch(decoded))
    assert again == decoded
    assert again.events == decoded.events and (again.ts, again.rank) == (decoded.ts, decoded.rank)


def decode_or_reject(data: bytes) -> None:
    """``data`` either decodes, and then round-trips, or is rejected with ``EventDecodeError`` and nothing else."""
    try:
        decoded = decode_batch(data)
    except EventDecodeError:
        return
    assert_round_trips(decoded)


@FAST
@given(st.binary(max_size=64))
def test_random_bytes_decode_or_raise_event_decode_error(data: bytes) -> None:
    decode_or_reject(data)


msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), U64_MAX) | st.floats() | st.text(max_size=8)
    | st.binary(max_size=9) | st.sampled_from(["type", "BlockStored", "BlockRemoved", "GPU", "AllBlocksCleared"]),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(
        st.sampled_from(["type", "block_hashes", "token_ids", "block_size", "parent_block_hash", "medium"]),
        inner, max_size=5),
    max_leaves=20,
)


@FAST
@given(msgpack_values)
def test_random_msgpack_structures_decode_or_raise_event_decode_error(value: object) -> None:
    decode_or_reject(wire(value))


# A batch's frame with each part either well formed or anything msgpack carries: about a third of these decode
# (where fully random structures almost never do), so the round trip of what decodes is exercised too.
raw_events = (any_events.map(lambda e: event_maps(EventBatch(0.0, [e]))[0]) | any_events.map(vllm_array)
              | msgpack_values)
near_batches = st.builds(list, st.tuples(st.floats(allow_nan=False, allow_infinity=False) | msgpack_values,
                                         st.lists(raw_events, max_size=4), st.none() | small | msgpack_values))


@FAST
@given(near_batches)
def test_nearly_valid_batches_decode_and_round_trip_or_raise_event_decode_error(value: list[object]) -> None:
    decode_or_reject(wire(value))


@FAST
@given(batches.filter(lambda b: len(encode_batch(b)) > 1), st.data())
def test_generated_truncations_are_rejected(batch: EventBatch, data: st.DataObject) -> None:
    encoded = encode_batch(batch)
    assert decode_batch(encoded).events == batch.events, "whole, the same bytes decode to the batch's events"
    rejects(encoded[:data.draw(st.integers(0, len(encoded) - 1))])


# --- the typed fast path and the index's view ----------------------------------------------------------

def view_as_batch(data: bytes) -> EventBatch:
    """``decode_view``'s batch with each event rebuilt as its class, token ids taken from ``decode_batch``."""
    view, full = decode_view(data), decode_batch(data)
    events = []
    for ev, whole in zip(view.events, full.events, strict=True):
        cls = EVENT_CLASS[type(ev)]
        assert cls is type(whole)
        if cls is type(ev):
            events.append(ev)
        else:
            values = {f.name: getattr(ev, f.name) for f in dataclasses.fields(cls)}
            if cls is BlockStored:
                values["token_ids"] = whole.token_ids
            events.append(cls(**values))
    return EventBatch(view.ts, events, view.rank)


@FAST
@given(near_batches)
def test_typed_decoder_and_checked_decoder_agree(value: list[object]) -> None:
    """The msgspec path decodes exactly what the field-by-field path does, and refuses nothing it accepts."""
    data = wire(value)
    try:
        checked = events_module._decode_checked(data)
    except EventDecodeError as e:
        for decode in (decode_batch, decode_view):
            with pytest.raises(EventDecodeError) as fast:
                decode(data)
            assert str(fast.value) == str(e)
        return
    assert decode_batch(data) == checked
    assert view_as_batch(data) == checked


@FAST
@given(batches)
def test_view_reads_what_decode_batch_reads(batch: EventBatch) -> None:
    assert view_as_batch(encode_batch(batch)) == batch


def test_view_checks_token_ids_as_decode_batch_does() -> None:
    good = event_maps(EventBatch(0.0, [make_stored()]))[0]
    for bad in (3, [-1, "a"], [{}]):   # bad input is refused whichever decoder reads it, and names the field
        data = wire([0.0, [{**good, "token_ids": bad}], 0])
        assert "token_ids" in rejects(data)
        with pytest.raises(EventDecodeError, match="token_ids"):
            decode_view(data)
    assert [EVENT_CLASS[type(e)] for e in decode_view(wire([0.0, [good], 0])).events] == [BlockStored]


#: Items of a token array in any encoding a writer may pick: every int format that can hold a non-negative value
#: (the signed ones too), and what is no token id (negative ints in every signed format, other types).
_INT_FORMATS = [(0xCC, "B"), (0xCD, ">H"), (0xCE, ">I"), (0xCF, ">Q"), (0xD0, "b"), (0xD1, ">h"), (0xD2, ">i"),
                (0xD3, ">q")]
_SIGNED = [f for f in _INT_FORMATS if f[0] >= 0xD0]
token_ids_as_written = st.one_of(
    st.integers(0, 0x7F).map(lambda v: bytes([v])),                  # positive fixint
    st.sampled_from(_INT_FORMATS).flatmap(lambda f: st.integers(0, _format_range(f[1])[1]).map(
        lambda v: bytes([f[0]]) + struct.pack(f[1], v))),
)
not_token_ids = st.one_of(
    st.integers(-32, -1).map(lambda v: struct.pack("b", v)),         # negative fixint
    st.sampled_from(_SIGNED).flatmap(lambda f: st.integers(_format_range(f[1])[0], -1).map(
        lambda v: bytes([f[0]]) + struct.pack(f[1], v))),
    st.sampled_from([b"\xc0", b"\xc2", b"\xc3", b"\xca\x00\x00\x00\x00", b"\xa1a", b"\x90", b"\x80"]),
)


def _format_range(fmt: str) -> tuple[int, int]:
    bits = struct.calcsize(fmt) * 8
    return (0, 2**bits - 1) if fmt.lstrip(">").isupper() else (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1)


def _array_header(n: int, wide: int) -> bytes:
    """A msgpack array header for ``n`` items: the shortest form, or array 16 / array 32 when ``wide`` says so."""
    if wide == 0 and n < 16:
        return bytes([0x90 | n])
    return b"\xdc" + struct.pack(">H", n) if wide < 2 and n < 2**16 else b"\xdd" + struct.pack(">I", n)


def _with_raw_tokens(raw: bytes) -> bytes:
    """A one-event batch whose BlockStored carries ``raw`` as its token ids, as written."""
    event = event_maps(EventBatch(0.0, [make_stored()]))[0]
    body = b"".join(wire(k) + (raw if k == "token_ids" else wire(v)) for k, v in event.items())
    return b"\x93" + wire(0.0) + b"\x91" + bytes([0x80 | len(event)]) + body + wire(0)


_TOKEN_LIST = msgspec.msgpack.Decoder(list[Annotated[int, msgspec.Meta(ge=0)]])


@FAST
@given(st.lists(token_ids_as_written, max_size=40), st.none() | st.tuples(not_token_ids, st.integers(0, 40)),
       st.integers(0, 2))
def test_view_refuses_exactly_the_token_ids_decode_batch_refuses(tokens: list[bytes], bad: tuple[bytes, int] | None,
                                                                wide: int) -> None:
    """The view's compiled check of raw token ids against msgspec's ``list[int >= 0]`` and ``decode_batch``'s
    checks, over every msgpack int encoding (a false refusal would only cost time, so it is checked alone too)."""
    if bad is not None:
        tokens.insert(bad[1], bad[0])
    raw = _array_header(len(tokens), wide) + b"".join(tokens)
    try:
        _TOKEN_LIST.decode(raw)
        typed = True
    except msgspec.ValidationError:
        typed = False
    assert all_non_negative_int_arrays(raw, 1) is typed
    data = _with_raw_tokens(raw)
    try:
        whole = decode_batch(data)
    except EventDecodeError as e:
        with pytest.raises(EventDecodeError) as view:
            decode_view(data)
        assert str(view.value) == str(e) and "token_ids" in str(e)
        return
    assert view_as_batch(data) == whole


def test_the_token_check_wants_exactly_the_arrays_it_is_told_of() -> None:
    two = wire([1, 2]) + wire([300, 70000, 2**40])
    assert all_non_negative_int_arrays(two, 2)
    assert not all_non_negative_int_arrays(two, 1), "bytes past the arrays named"
    assert not all_non_negative_int_arrays(two, 3), "an array short"
    assert not all_non_negative_int_arrays(two[:-1], 2), "the last int cut"
    assert all_non_negative_int_arrays(b"", 0)


@pytest.mark.parametrize("data", [VLLM_MAP, VLLM_ARRAY], ids=["map", "array"])
def test_view_reads_both_vllm_layouts(data: bytes) -> None:
    assert view_as_batch(data) == decode_batch(data)


# --- KV cache groups (attention windows) --------------------------------------------------------------------------

GROUPED_VLLM = [
    {"type": "BlockStored", "block_hashes": [H1], "parent_block_hash": None, "token_ids": [1, 2, 3, 4],
     "block_size": 4, "lora_id": None, "medium": "GPU", "lora_name": None, "extra_keys": None, "group_idx": 1,
     "kv_cache_spec_kind": "sliding_window", "kv_cache_spec_sliding_window": 512},
    {"type": "BlockRemoved", "block_hashes": [H1], "medium": "GPU", "group_idx": 1},
]


@pytest.mark.parametrize("layout", ["map", "array"])
def test_vllm_group_fields_decode_in_both_layouts_and_both_decoders(layout: str) -> None:
    raws = GROUPED_VLLM if layout == "map" else [["BlockStored", [H1], None, [1, 2, 3, 4], 4, None, "GPU", None, None,
                                                  1, "sliding_window", 512], ["BlockRemoved", [H1], "GPU", 1]]
    data = wire([1.0, raws, 0])
    stored, removed = decode_batch(data).events
    assert (stored.group_idx, stored.kv_cache_spec_kind, stored.kv_cache_spec_sliding_window) == (1, "sliding_window",
                                                                                                  512)
    assert removed.group_idx == 1
    view = decode_view(data).events
    assert [(e.group_idx, getattr(e, "kv_cache_spec_sliding_window", None)) for e in view] == [(1, 512), (1, None)]
    assert decode_batch(encode_batch(decode_batch(data))) == decode_batch(data)


def test_batches_without_the_group_fields_take_their_defaults() -> None:
    """vLLM before groups, and our own batches from before ``kv_cache_spec_sliding_window`` and
    ``BlockUpdated.group_idx``: one window, group 0."""
    old_ours = [{k: v for k, v in GROUPED_VLLM[0].items() if not k.startswith("kv_cache_spec_sliding")},
                {"type": "BlockUpdated", "block_hash": H2, "old_medium": "GPU", "new_medium": "CPU",
                 "old_priority": None, "new_priority": None}]
    old_ours[0]["group_idx"] = 0
    stored, updated = decode_batch(wire([1.0, old_ours, 0])).events
    assert (stored.group_idx, stored.kv_cache_spec_sliding_window, updated.group_idx) == (0, None, 0)
    stored, = decode_batch(wire([1.0, [{k: v for k, v in GROUPED_VLLM[0].items() if "kv_cache_spec" not in k
                                        and k != "group_idx"}], 0])).events
    assert (stored.group_idx, stored.kv_cache_spec_kind, stored.kv_cache_spec_sliding_window) == (0, None, None)
    with pytest.raises(EventDecodeError, match="kv_cache_spec_sliding_window: expected a positive int"):
        decode_batch(wire([1.0, [{**GROUPED_VLLM[0], "kv_cache_spec_sliding_window": 0}], 0]))
