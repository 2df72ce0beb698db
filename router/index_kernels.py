"""The compiled loops behind ``ArrayIndex``: open-addressing tables over numpy arrays, apply and match.

Two tables share one layout and one set of loops: ``keys`` (uint64), ``tags``
(int32, -1 where a slot is empty) and a payload row per slot (uint64 words).
The block table maps a hash to its holder mask (one bit per rank, ``W`` words)
and tags each slot with how many ranks hold it on the host tier only. The refs
table keeps the refs of a ``(hash, rank bit)`` pair only where they are not the
common one device ref (``DEV``); its tag is the bit. Slots are found by linear
probing from a multiplicative hash scaled to any capacity (not only powers of
two, so the tables grow by half and stay dense), and freed by backward shift,
so there are no tombstones. Callers (``router.array_index``) grow the tables
before a call so that no loop here allocates.

Every change is ``_set_refs`` of one pair, returning the old value, which
apply logs, so a batch that diverges is undone by setting the logged values
back, newest first. Compiled on first call and cached on disk (``cache=True``).
"""
from __future__ import annotations

import numpy as np
from numba import njit

U1 = np.uint64(1)
U32 = np.uint64(32)
LOW32 = np.uint64(0xFFFFFFFF)
DEV = np.uint64(1)
HOST = np.uint64(1 << 32)
_MIX = np.uint64(0x9E3779B97F4A7C15)
_BIT_MIX = np.uint64(0xC2B2AE3D27D4EB4F)

STORE, REMOVE, MOVE, CLEAR = 0, 1, 2, 3   # op kinds of ``apply_ops``
OP_FIELDS = 5                             # per op: kind, unit, new unit (moves), hashes, event index


@njit(cache=True)
def _home(key, tag, keyed, cap):
    """The first slot to probe: the mixed key's top bits scaled to ``cap`` (``tag`` mixed in when it is keyed)."""
    x = key ^ (np.uint64(tag) * _BIT_MIX) if keyed else key
    x = x * _MIX
    return np.int64(((x >> U32) * np.uint64(cap) + (((x & LOW32) * np.uint64(cap)) >> U32)) >> U32)


@njit(cache=True)
def _find(keys, tags, key, tag, keyed):
    """The slot of ``key`` (and ``tag``, when keyed), or -1."""
    cap = keys.shape[0]
    i = _home(key, tag, keyed, cap)
    while tags[i] >= 0:
        if keys[i] == key and (not keyed or tags[i] == tag):
            return i
        i += 1
        if i == cap:
            i = 0
    return -1


@njit(cache=True)
def _insert(keys, tags, key, tag, keyed):
    """A free slot for ``key`` (absent), tagged ``tag``; its payload row is zero."""
    cap = keys.shape[0]
    i = _home(key, tag, keyed, cap)
    while tags[i] >= 0:
        i += 1
        if i == cap:
            i = 0
    keys[i] = key
    tags[i] = tag
    return i


@njit(cache=True)
def _delete(keys, tags, rows, i, keyed):
    """Free slot ``i``, shifting back the entries after it that probed past it."""
    cap = keys.shape[0]
    j = i
    while True:
        j += 1
        if j == cap:
            j = 0
        if tags[j] < 0:
            break
        k = _home(keys[j], tags[j], keyed, cap)
        stays = (i < k <= j) if i <= j else (k > i or k <= j)
        if stays:
            continue
        keys[i] = keys[j]
        tags[i] = tags[j]
        rows[i, :] = rows[j, :]
        i = j
    tags[i] = -1
    rows[i, :] = 0


@njit(cache=True)
def rehash(keys, tags, rows, new_keys, new_tags, new_rows, keyed):
    """Copy every entry into the (larger, or wider) new arrays, all empty."""
    words = rows.shape[1]
    for i in range(keys.shape[0]):
        if tags[i] >= 0:
            j = _insert(new_keys, new_tags, keys[i], tags[i], keyed)
            new_rows[j, :words] = rows[i, :]


@njit(cache=True)
def _refs(keys, tags, masks, rkeys, rtags, rvals, h, bit):
    """``bit``'s packed refs on ``h`` (0: none) and ``h``'s block slot (-1: nobody holds it)."""
    s = _find(keys, tags, h, 0, False)
    if s < 0 or not (masks[s, bit >> 6] >> np.uint64(bit & 63)) & U1:
        return np.uint64(0), s
    r = _find(rkeys, rtags, h, bit, True)
    return (DEV if r < 0 else rvals[r, 0]), s


@njit(cache=True)
def _host_only(v):
    return v != 0 and (v & LOW32) == 0


@njit(cache=True)
def _set_refs(keys, tags, masks, rkeys, rtags, rvals, counts, bit, h, v):
    """Make ``bit``'s packed refs on ``h`` ``v``; returns the old value. ``counts``: [blocks, refs entries,
    then per bit: blocks held, blocks held on the host tier only]."""
    old, s = _refs(keys, tags, masks, rkeys, rtags, rvals, h, bit)
    if old == v:
        return old
    word, one = bit >> 6, U1 << np.uint64(bit & 63)
    if s < 0:
        s = _insert(keys, tags, h, 0, False)
        counts[0] += 1
    r = _find(rkeys, rtags, h, bit, True) if old != DEV and old != 0 else -1
    if v == DEV or v == 0:
        if r >= 0:
            _delete(rkeys, rtags, rvals, r, True)
            counts[1] -= 1
    else:
        if r < 0:
            r = _insert(rkeys, rtags, h, bit, True)
            counts[1] += 1
        rvals[r, 0] = v
    host_change = np.int32(_host_only(v)) - np.int32(_host_only(old))
    tags[s] += host_change
    counts[3 + 2 * bit] += host_change
    if old == 0:
        masks[s, word] |= one
        counts[2 + 2 * bit] += 1
    elif v == 0:
        masks[s, word] &= ~one
        counts[2 + 2 * bit] -= 1
        if not masks[s].any():
            _delete(keys, tags, masks, s, False)
            counts[0] -= 1
    return old


@njit(cache=True)
def set_all(keys, tags, masks, rkeys, rtags, rvals, counts, bit, hs, vs):
    """``_set_refs`` of each pair, in order (a snapshot installed, a purge)."""
    for k in range(hs.shape[0]):
        _set_refs(keys, tags, masks, rkeys, rtags, rvals, counts, bit, hs[k], vs[k])


@njit(cache=True)
def held(keys, tags, masks, rkeys, rtags, rvals, bit, out_h, out_v, start):
    """Write ``bit``'s ``(hash, refs)`` pairs into ``out_h``/``out_v`` from ``start``; returns the end."""
    word, one = bit >> 6, U1 << np.uint64(bit & 63)
    n = start
    for i in range(keys.shape[0]):
        if tags[i] >= 0 and masks[i, word] & one:
            h = keys[i]
            r = _find(rkeys, rtags, h, bit, True)
            out_h[n] = h
            out_v[n] = DEV if r < 0 else rvals[r, 0]
            n += 1
    return n


@njit(cache=True)
def _held_on(v, unit):
    return (v >> U32) != 0 if unit == HOST else (v & LOW32) != 0


@njit(cache=True)
def apply_ops(keys, tags, masks, rkeys, rtags, rvals, counts, bit, ops, hs, log_h, log_v):
    """Apply a batch's ops (``OP_FIELDS`` ints each) for ``bit``, all or none. Returns ``(-1, 0, 0)``, or, for a
    removal or move of a block not held on that tier (everything undone): ``(event index, hash, unit)``."""
    n_log = 0
    p = 0
    for o in range(ops.shape[0] // OP_FIELDS):
        f = o * OP_FIELDS
        kind, n, event = ops[f], ops[f + 3], ops[f + 4]
        unit, new_unit = np.uint64(ops[f + 1]), np.uint64(ops[f + 2])
        if kind == CLEAR:
            start = n_log
            n_log = held(keys, tags, masks, rkeys, rtags, rvals, bit, log_h, log_v, start)
            set_all(keys, tags, masks, rkeys, rtags, rvals, counts, bit, log_h[start:n_log],
                    np.zeros(n_log - start, np.uint64))
        for k in range(p, p + n):
            h = hs[k]
            v, _ = _refs(keys, tags, masks, rkeys, rtags, rvals, h, bit)
            if kind == STORE:
                w = v + unit
            elif _held_on(v, unit):
                w = v - unit + (new_unit if kind == MOVE else np.uint64(0))
            else:
                for e in range(n_log - 1, -1, -1):
                    _set_refs(keys, tags, masks, rkeys, rtags, rvals, counts, bit, log_h[e], log_v[e])
                return event, h, unit
            log_h[n_log] = h
            log_v[n_log] = _set_refs(keys, tags, masks, rkeys, rtags, rvals, counts, bit, h, w)
            n_log += 1
        p += n
    return -1, np.uint64(0), np.uint64(0)


@njit(cache=True)
def _bit_index(low):
    """The position of the single set bit ``low``."""
    b = 0
    while low > U1:
        low >>= U1
        b += 1
    return b


@njit(cache=True)
def match_walk(keys, tags, masks, rkeys, rtags, rvals, bit_rank, q, out, slots):
    """Per bit holding ``q[0]``: its held prefix of ``q`` and the host-only blocks within it. Writes, in order of
    (blocks, bit), ``out[0]`` the bits, ``out[1]`` their ranks (``bit_rank``), ``out[2]`` the blocks and
    ``out[3]`` the host-only blocks; then the runs of one answer, ``out[4]`` their lengths, ``out[5]`` their
    blocks, ``out[6]`` their host-only blocks. Returns (ranks, runs). One lookup per block, and per-bit work
    only where the holders change; ``slots`` is scratch (one per block)."""
    n = q.shape[0]
    words = masks.shape[1]
    s = _find(keys, tags, q[0], 0, False)
    if s < 0:
        return 0, 0
    active = masks[s].copy()
    slots[0] = s
    prev = s
    k = 0
    end = n
    for j in range(1, n + 1):
        s = _find(keys, tags, q[j], 0, False) if j < n else -1
        if j < n:
            slots[j] = s
            if s == prev:
                continue
        left = False
        for w in range(words):
            lost = active[w] & ~masks[s, w] if s >= 0 else active[w]
            if lost:
                active[w] &= ~lost
                while lost:
                    low = lost & (~lost + U1)
                    out[0, k] = w * 64 + _bit_index(low)
                    out[2, k] = j
                    k += 1
                    lost ^= low
            left = left or active[w] != 0
        if not left:
            end = j
            break
        prev = s
    out[3, :k] = 0
    for j in range(end):
        s = slots[j]
        if tags[s] == 0:
            continue
        for i in range(k):
            if out[2, i] > j:
                r = _find(rkeys, rtags, q[j], out[0, i], True)
                if r >= 0 and _host_only(rvals[r, 0]):
                    out[3, i] += 1
    runs = 0
    for i in range(k):
        out[1, i] = bit_rank[out[0, i]]
        if i and out[2, i] == out[2, i - 1] and out[3, i] == out[3, i - 1]:
            out[4, runs - 1] += 1
        else:
            out[4, runs] = 1
            out[5, runs] = out[2, i]
            out[6, runs] = out[3, i]
            runs += 1
    return k, runs


@njit(cache=True)
def refs_of(keys, tags, masks, rkeys, rtags, rvals, bit, hs, out):
    """``bit``'s packed refs on each of ``hs`` into ``out`` (0: not held)."""
    for i in range(hs.shape[0]):
        out[i] = _refs(keys, tags, masks, rkeys, rtags, rvals, hs[i], bit)[0]
