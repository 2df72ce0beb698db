"""The block-event schema and its msgpack codec: the one definition the worker and the router share.

Events follow TensorRT-LLM's four kinds (created, stored, removed, updated) plus
all-cleared. On the wire a batch is ``[ts, events, rank]`` and each event a map
whose first entry is ``"type": <name>``, as vLLM >= 0.24 writes them, so the
router can index a real vLLM engine too. The decoder also reads vLLM's older
array events (``[tag, field, ...]``, vLLM <= 0.23) and rejects anything else
with ``EventDecodeError``.

Decoding is msgspec's typed decoder first (the map layout, every field checked
in C), and the field-by-field decoder for whatever it refuses: the array
layout, hashes sent as bytes, and every malformed batch, so an error message is
the same whichever path saw the bytes first. ``decode_view`` is the router
index's decode: the same checks and errors, but token ids (which the index
never reads) stay msgpack, checked by a compiled walk of their bytes
(``int_arrays``), since building them into ints cost as much as the rest of
the apply.
"""
from __future__ import annotations

import functools
import math
import reprlib
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field, fields
from typing import Annotated, Literal, Union

import msgpack
import msgspec
from msgspec.structs import astuple

Medium = Literal["GPU", "CPU"]


@dataclass(slots=True)
class BlockStored:
    """Full blocks became reusable; ``block_hashes[i]`` follows ``block_hashes[i-1]`` (the first follows the parent)."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: Medium | None = "GPU"
    lora_name: str | None = None
    cache_salt: str | None = None
    priority: int | None = None
    group_idx: int = 0
    """The KV cache group (attention window) of the blocks, as vLLM numbers its groups; 0 for one window."""
    kv_cache_spec_kind: str | None = None
    """``"full_attention"`` or ``"sliding_window"`` (vLLM's ``KVCacheSpecKind`` values); ``None`` from a rank that
    does not say (a model without ``attention_windows``, an older vLLM)."""
    extra_keys: list[list | None] | None = None
    """vLLM's per-block extra keys, untagged as it publishes them (LoRA name, ``[mm id, offset]`` pairs, cache
    salt, prompt-embeds digests); kvledger's own ranks send none. Kept so a salted vLLM block maps right."""
    kv_cache_spec_sliding_window: int | None = None
    """The group's window in tokens, for a sliding window (vLLM's field of the same name)."""


@dataclass(slots=True)
class BlockRemoved:
    """Blocks no longer held on ``medium`` (evicted or overwritten)."""

    block_hashes: list[int]
    medium: Medium | None = "GPU"
    group_idx: int = 0


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """Every block of the rank is gone (reset)."""


@dataclass(frozen=True, slots=True)
class KVCacheCreated:
    """A ledger came up with these blocks per tier: one event per attention window, each counting its own pool, as
    TensorRT-LLM enqueues one created event per window size (a sum over windows would be no pool's size)."""

    num_blocks: dict[str, int]
    block_size: int
    group_idx: int = 0
    """The attention window group the counts are of (as ``BlockStored.group_idx``); 0 for one window."""
    kv_cache_spec_kind: str | None = None
    """``"full_attention"`` or ``"sliding_window"``, as ``BlockStored`` says it; ``None`` from a ledger without
    ``attention_windows`` (and from older ranks)."""
    kv_cache_spec_sliding_window: int | None = None
    """The group's window in tokens, for a sliding window."""


@dataclass(slots=True)
class BlockUpdated:
    """A held block changed tier (offload, onboard) or retention priority; ``None`` = unchanged."""

    block_hash: int
    old_medium: Medium | None = None
    new_medium: Medium | None = None
    old_priority: int | None = None
    new_priority: int | None = None
    group_idx: int = 0
    """The attention window group of the block (as ``BlockStored.group_idx``)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared | KVCacheCreated | BlockUpdated


@dataclass(frozen=True, slots=True)
class EventBatch:
    """One numbered publication of a rank's events (numbering lives with the publisher)."""

    ts: float
    events: list[KVEvent] = field(default_factory=list)
    rank: int | None = None


# --- codec -----------------------------------------------------------------
#
# Decoding sits on the router's hot path, so each field is checked by one small
# function looked up once per event kind at import (no per-event reflection),
# and lists of hashes or tokens are checked with C-level passes (``map(type)``,
# ``min``) before any per-item Python work.


class EventDecodeError(ValueError):
    """Bytes that are not a well-formed event batch; the message names the first bad part."""


_U64_MAX = 2**64 - 1
_INT_ONLY = frozenset({int})
_MEDIA = frozenset({"GPU", "CPU"})


class _Missing:
    """Default of a field that has none: a required field absent from the wire."""

    def __repr__(self) -> str:
        return "nothing (required field missing)"


_MISSING = _Missing()


def _bad(where: str, expected: str, got: object) -> EventDecodeError:
    shown = repr(got) if got is _MISSING else f"{type(got).__name__} {reprlib.repr(got)}"
    return EventDecodeError(f"{where}: expected {expected}, got {shown}")


def _as_hash(v: object) -> int | None:
    """A u64 hash from an int, or from bytes (vLLM's non-int hashes: the first 8 bytes, big-endian,
    as ``block_key`` folds its digest); ``None`` when ``v`` is neither."""
    if type(v) is int:
        return v if 0 <= v <= _U64_MAX else None
    if type(v) is bytes and v:
        return int.from_bytes(v[:8], "big")
    return None


def check_hash(v: object, where: str) -> int:
    h = _as_hash(v)
    if h is None:
        raise _bad(where, "a u64 hash (int 0..2**64-1 or non-empty bytes)", v)
    return h


def _opt_hash(v: object, where: str) -> int | None:
    return None if v is None else check_hash(v, where)


def _hash_list(v: object, where: str) -> list[int]:
    if type(v) is not list:
        raise _bad(where, "a list of u64 hashes", v)
    if _INT_ONLY.issuperset(map(type, v)) and (not v or (min(v) >= 0 and max(v) <= _U64_MAX)):
        return v
    return [check_hash(h, f"{where}[{i}]") for i, h in enumerate(v)]


def _token_list(v: object, where: str) -> list[int]:
    if type(v) is not list or not _INT_ONLY.issuperset(map(type, v)) or (v and min(v) < 0):
        raise _bad(where, "a list of non-negative int token ids", v)
    return v


def _positive_int(v: object, where: str) -> int:
    if type(v) is not int or v <= 0:
        raise _bad(where, "a positive int", v)
    return v


def _opt_positive_int(v: object, where: str) -> int | None:
    return None if v is None else _positive_int(v, where)


def _count(v: object, where: str) -> int:
    if type(v) is not int or v < 0:
        raise _bad(where, "a non-negative int", v)
    return v


def _opt_count(v: object, where: str) -> int | None:
    return None if v is None else _count(v, where)


def _opt_priority(v: object, where: str) -> int | None:
    if v is None or (type(v) is int and 0 <= v <= 100):
        return v
    raise _bad(where, "a priority (int 0..100) or None", v)


def check_medium(v: object, where: str) -> Medium | None:
    if v is None or (type(v) is str and v in _MEDIA):
        return v  # type: ignore[return-value]  # narrowed to the Literal by the check above
    raise _bad(where, "'GPU', 'CPU' or None", v)


def _opt_extra_keys(v: object, where: str) -> list | None:
    if v is None or type(v) is list and all(k is None or type(k) is list for k in v):
        return v
    raise _bad(where, "None or a list with a list (or None) per block", v)


def _opt_str(v: object, where: str) -> str | None:
    if v is None or type(v) is str:
        return v
    raise _bad(where, "a str or None", v)


def _tier_counts(v: object, where: str) -> dict[str, int]:
    if type(v) is not dict or not all(type(k) is str and type(n) is int and n >= 0 for k, n in v.items()):
        raise _bad(where, "a map of tier name (str) to non-negative int", v)
    return v


_Check = Callable[[object, str], object]

#: How every event field is checked, by name; a field missing here fails at import.
_CHECKS: dict[str, _Check] = {
    "block_hashes": _hash_list,
    "parent_block_hash": _opt_hash,
    "token_ids": _token_list,
    "block_size": _count,   # 0: vLLM's offloading names stored hashes only (no tokens, no size)
    "lora_id": _opt_count,
    "medium": check_medium,
    "lora_name": _opt_str,
    "cache_salt": _opt_str,
    "priority": _opt_priority,
    "group_idx": _count,
    "kv_cache_spec_kind": _opt_str,
    "extra_keys": _opt_extra_keys,
    "kv_cache_spec_sliding_window": _opt_positive_int,
    "num_blocks": _tier_counts,
    "block_hash": check_hash,
    "old_medium": check_medium,
    "new_medium": check_medium,
    "old_priority": _opt_priority,
    "new_priority": _opt_priority,
}

#: Where vLLM's array layout (<= 0.23) puts BlockStored's fields (it has no ``cache_salt``/``priority``).
#: Every other kind's array lists its fields in declaration order after the tag.
_VLLM_ARRAY_SLOTS: dict[str, int] = {
    "block_hashes": 1, "parent_block_hash": 2, "token_ids": 3, "block_size": 4, "lora_id": 5,
    "medium": 6, "lora_name": 7, "extra_keys": 8, "group_idx": 9, "kv_cache_spec_kind": 10,
    "kv_cache_spec_sliding_window": 11,
}


@dataclass(frozen=True, slots=True)
class _Kind:
    """One event class's wire description, derived once from its dataclass fields."""

    cls: type[KVEvent]
    tag: str
    names: tuple[str, ...]
    checks: tuple[_Check, ...]
    wheres: tuple[str, ...]        # "BlockStored.token_ids", for error messages
    defaults: tuple[object, ...]   # _MISSING where the field is required
    slots: tuple[int, ...]         # index in the array layout; 0 = not carried there

    @classmethod
    def of(cls, event_cls: type[KVEvent]) -> _Kind:
        fs = fields(event_cls)
        names = tuple(f.name for f in fs)
        tag = event_cls.__name__
        slots = (tuple(_VLLM_ARRAY_SLOTS.get(n, 0) for n in names) if event_cls is BlockStored
                 else tuple(range(1, len(names) + 1)))
        return cls(event_cls, tag, names, tuple(_CHECKS[n] for n in names),
                   tuple(f"{tag}.{n}" for n in names),
                   tuple(_MISSING if f.default is MISSING else f.default for f in fs), slots)

    def from_map(self, m: dict[object, object]) -> KVEvent:
        """vLLM >= 0.24 layout: unknown keys are ignored, absent optional keys take their default."""
        get = m.get
        return self.cls(*[check(get(name, d), where) for check, name, where, d
                          in zip(self.checks, self.names, self.wheres, self.defaults)])

    def from_array(self, a: list[object]) -> KVEvent:
        """vLLM <= 0.23 layout: trailing optional fields may be absent, extra trailing ones are ignored."""
        n = len(a)
        return self.cls(*[check(a[s] if 0 < s < n else d, where) for check, s, where, d
                          in zip(self.checks, self.slots, self.wheres, self.defaults)])

    def check(self, e: KVEvent, where: str) -> None:
        """The decoder's checks on an event built in this process: each field must be what decoding
        would have produced (so a hash given as bytes, which the wire may carry, is refused here)."""
        for check, name in zip(self.checks, self.names):
            v = getattr(e, name)
            if check(v, f"{where}.{name}") is not v:
                raise _bad(f"{where}.{name}", "the decoded form (hashes as u64 ints)", v)

    def to_map(self, e: KVEvent) -> dict[str, object]:
        """``"type"`` first, then the fields in declaration order, so vLLM-style readers can read it."""
        out: dict[str, object] = {"type": self.tag}
        for name in self.names:
            out[name] = getattr(e, name)
        return out


_KINDS: dict[str, _Kind] = {k.tag: k for k in map(_Kind.of, (BlockStored, BlockRemoved, AllBlocksCleared,
                                                             KVCacheCreated, BlockUpdated))}
_KIND_OF_CLASS: dict[type, _Kind] = {k.cls: k for k in _KINDS.values()}


def encode_batch(batch: EventBatch) -> bytes:
    """msgpack ``[ts, events, rank]`` with map events (see the module docstring)."""
    try:
        events = [_KIND_OF_CLASS[type(e)].to_map(e) for e in batch.events]
    except KeyError as e:
        raise TypeError(f"not a KVEvent: {e.args[0].__name__}; build events from kvledger.worker.wire.events") from None
    return msgpack.packb([batch.ts, events, batch.rank], use_bin_type=True)


def check_event(ev: object, where: str = "event") -> None:
    """Validate an event built in this process with the codec's own per-field checks (one validator for
    the wire and for in-process callers such as the router's index). ``TypeError`` for an object that is
    no event; ``EventDecodeError`` (a ``ValueError``) naming the first bad field otherwise."""
    kind = _KIND_OF_CLASS.get(type(ev))
    if kind is None:
        raise TypeError(f"{where} must be a KVEvent ({', '.join(sorted(_KINDS))}), got {type(ev).__name__}")
    kind.check(ev, where)


def check_batch(batch: object) -> None:
    """``check_event`` over a batch built in this process: ``TypeError`` for what is no ``EventBatch`` of a list of
    events, ``EventDecodeError`` naming the first bad field otherwise."""
    if not isinstance(batch, EventBatch):
        raise TypeError(f"batch must be a kvledger.worker.wire.events.EventBatch, got {type(batch).__name__}")
    if type(batch.events) is not list:
        raise TypeError(f"batch.events must be a list, got {type(batch.events).__name__}")
    for i, ev in enumerate(batch.events):
        check_event(ev, f"events[{i}]")


def _decode_event(raw: object) -> KVEvent:
    if type(raw) is dict:
        tag = raw.get("type", _MISSING)
        kind = _KINDS.get(tag) if type(tag) is str else None
        if kind is None:
            raise _bad("event", f"'type' one of {sorted(_KINDS)}", tag)
        return kind.from_map(raw)
    if type(raw) is list and raw:
        tag = raw[0]
        kind = _KINDS.get(tag) if type(tag) is str else None
        if kind is None:
            raise _bad("event", f"a tag one of {sorted(_KINDS)}", tag)
        return kind.from_array(raw)
    raise _bad("event", "a map or a non-empty tagged array", raw)


def _decode_checked(data: bytes) -> EventBatch:
    """The field-by-field decoder: either layout, hashes as bytes, and the error naming the first bad part."""
    try:
        obj = msgpack.unpackb(data, raw=False)
    except ValueError as e:  # every msgpack unpack error (ExtraData, OutOfData, FormatError, StackError) is one
        raise EventDecodeError(f"not one msgpack value: {type(e).__name__}: {e}") from None
    if type(obj) is not list or not 2 <= len(obj) <= 3:
        raise _bad("batch", "an array [ts, events, rank] (rank optional)", obj)
    ts, events = obj[0], obj[1]
    rank = obj[2] if len(obj) == 3 else None
    if type(ts) not in (float, int) or not math.isfinite(ts):
        raise _bad("batch ts", "a finite float or int", ts)
    if rank is not None and (type(rank) is not int or rank < 0):
        raise _bad("batch rank", "a non-negative int or None", rank)
    if type(events) is not list:
        raise _bad("batch events", "a list", events)
    out: list[KVEvent] = []
    for i, raw in enumerate(events):
        try:
            out.append(_decode_event(raw))
        except EventDecodeError as e:
            raise EventDecodeError(f"events[{i}]: {e}") from None
    return EventBatch(float(ts), out, rank)


# --- the typed fast path (msgspec) -----------------------------------------

_Nat = Annotated[int, msgspec.Meta(ge=0)]   # msgpack carries no int past 2**64 - 1, so this is a u64 too
_MediumType = Union[Literal["GPU", "CPU"], None]
_PriorityType = Union[Annotated[int, msgspec.Meta(ge=0, le=100)], None]

#: msgspec's type of every event field: ``_CHECKS`` again, run in C. It may refuse more than ``_CHECKS``
#: (hashes sent as bytes), never less; what it refuses goes to ``_decode_checked``.
_TYPES: dict[str, object] = {
    "block_hashes": list[_Nat],
    "parent_block_hash": Union[_Nat, None],
    "token_ids": list[_Nat],
    "block_size": _Nat,
    "lora_id": Union[_Nat, None],
    "medium": _MediumType,
    "lora_name": Union[str, None],
    "cache_salt": Union[str, None],
    "priority": _PriorityType,
    "group_idx": _Nat,
    "kv_cache_spec_kind": Union[str, None],
    "extra_keys": Union[list[Union[list, None]], None],
    "kv_cache_spec_sliding_window": Union[Annotated[int, msgspec.Meta(gt=0)], None],
    "num_blocks": dict[str, _Nat],
    "block_hash": _Nat,
    "old_medium": _MediumType,
    "new_medium": _MediumType,
    "old_priority": _PriorityType,
    "new_priority": _PriorityType,
}


def _wire_struct(event_cls: type[KVEvent], token_ids: object) -> type[msgspec.Struct]:
    """A map-layout struct tagged ``"type": <class name>`` with ``event_cls``'s fields in order, so that
    ``astuple`` of one is the argument list of the event."""
    spec: list[tuple[str, object] | tuple[str, object, object]] = []
    for f in fields(event_cls):
        typ = token_ids if f.name == "token_ids" else _TYPES[f.name]
        spec.append((f.name, typ) if f.default is MISSING else (f.name, typ, f.default))
    return msgspec.defstruct(f"{event_cls.__name__}Wire", spec, tag_field="type", tag=event_cls.__name__, gc=False)


def _batch_decoder(structs: list[type[msgspec.Struct]]) -> msgspec.msgpack.Decoder:
    """``[ts, events, rank]``; ``excess`` catches a fourth item, which msgspec would otherwise drop."""
    batch = msgspec.defstruct("BatchWire", [("ts", float), ("events", list[Union[tuple(structs)]]),
                                            ("rank", Union[_Nat, None], None), ("excess", msgspec.Raw, msgspec.Raw())],
                              array_like=True, gc=False)
    return msgspec.msgpack.Decoder(batch)


_WIRE: dict[type[KVEvent], type[msgspec.Struct]] = {k.cls: _wire_struct(k.cls, list[_Nat]) for k in _KINDS.values()}
_STORED_VIEW = _wire_struct(BlockStored, msgspec.Raw)
_DECODER = _batch_decoder(list(_WIRE.values()))
_VIEW_DECODER = _batch_decoder([_STORED_VIEW if cls is BlockStored else s for cls, s in _WIRE.items()])

#: The event class each decoded struct stands for, and each event class itself: what a reader of
#: ``decode_view`` dispatches on.
EVENT_CLASS: dict[type, type[KVEvent]] = {**{s: cls for cls, s in _WIRE.items()}, _STORED_VIEW: BlockStored,
                                          **{k.cls: k.cls for k in _KINDS.values()}}


@dataclass(frozen=True, slots=True)
class BatchView:
    """A batch as the router's index reads it (``decode_view``).

    Each event is a msgspec struct with its class's fields (``EVENT_CLASS[type(ev)]`` names the class),
    except that ``BlockStored.token_ids`` is the raw msgpack array, checked as ``decode_batch`` checks it;
    batches the typed decoder refuses but the checked one accepts carry the event classes themselves.
    """

    ts: float
    events: list[object]
    rank: int | None


def decode_batch(data: bytes) -> EventBatch:
    """Decode one batch in either vLLM layout, or raise ``EventDecodeError``; never a partial batch."""
    _check_bytes(data)
    try:
        wire = _DECODER.decode(data)
    except msgspec.DecodeError:
        return _decode_checked(data)
    if wire.excess or not math.isfinite(wire.ts):
        return _decode_checked(data)
    of = EVENT_CLASS
    return EventBatch(wire.ts, [of[type(e)](*astuple(e)) for e in wire.events], wire.rank)


def decode_view(data: bytes) -> BatchView:
    """``decode_batch``'s checks and errors, but with token ids left as msgpack (see ``BatchView``): they are
    checked (arrays of non-negative ints, as ``decode_batch`` wants) by one compiled pass over the batch's, and
    never built into lists."""
    _check_bytes(data)
    try:
        wire = _VIEW_DECODER.decode(data)
    except msgspec.DecodeError:
        wire = None
    if wire is None or wire.excess or not math.isfinite(wire.ts) or not _tokens_ok(wire.events):
        checked = _decode_checked(data)
        return BatchView(checked.ts, list(checked.events), checked.rank)
    return BatchView(wire.ts, wire.events, wire.rank)


@functools.cache
def _int_arrays() -> Callable[[bytes, int], bool]:
    """The compiled token check, imported on the first view decoded: only the router loads numba."""
    from kvledger.worker.wire.int_arrays import all_non_negative_int_arrays
    return all_non_negative_int_arrays


def _tokens_ok(events: list[object]) -> bool:
    """Whether every stored event's raw token ids are non-negative ints, in one compiled pass over them all."""
    raws = [e.token_ids for e in events if type(e) is _STORED_VIEW]
    return not raws or _int_arrays()(b"".join(raws), len(raws))


def _check_bytes(data: object) -> None:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise EventDecodeError(f"expected bytes, got {type(data).__name__}")
