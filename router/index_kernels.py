"""The compiled loops behind ``ArrayIndex``: open-addressing tables over numpy arrays, apply and match.

Two tables share one layout and one set of loops: one uint64 row per slot,
``[key, tag + 1, payload...]`` (a zero second word: the slot is empty), so a
lookup touches one cache line. The block table's row is ``[hash, meta]``:
its holder mask's id above bit 16 and, below, one more than the number of
ranks holding it on the host tier only. Masks (one bit per rank, ``W`` words)
are interned in a pool, refcounted, since a few holder sets cover most blocks:
a slot costs 16 bytes however many ranks there are. The refs table keeps the
refs of a ``(hash, rank bit)`` pair only where they are not the common one
device ref (``DEV``); its tag is the bit, its payload the packed refs. Slots are found by linear
probing from a multiplicative hash scaled to any capacity (not only powers of
two, so the tables grow by half and stay dense), and freed by backward shift,
so there are no tombstones. Callers (``router.array_index``) grow the tables
before a call so that no loop here allocates.

The mask pool is ``pool[id] = [refcount, words...]`` (id 0: the empty mask,
never counted), found by content through ``mtab`` (ids, 0 = empty), with
freed ids on the ``free`` stack; ``counts`` holds its high-water id and stack
depth. Every change is ``_set_refs`` of one pair, returning the old value, which
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
FIXED_COUNTS = 4   # counts: blocks, refs entries, masks' high-water id, free ids; then per bit: blocks, host-only
ID_SHIFT = np.uint64(16)
HOST_BITS = np.uint64(0xFFFF)
OP_FIELDS = 5                             # per op: kind, unit, new unit (moves), hashes, event index


@njit(cache=True, inline="always")
def _home(key, tag, keyed, cap):
    """The first slot to probe: the mixed key's top bits scaled to ``cap`` (``tag`` mixed in when it is keyed)."""
    x = key ^ (np.uint64(tag) * _BIT_MIX) if keyed else key
    x = x * _MIX
    return np.int64(((x >> U32) * np.uint64(cap) + (((x & LOW32) * np.uint64(cap)) >> U32)) >> U32)


@njit(cache=True, inline="always")
def _find(t, key, tag, keyed):
    """The slot of ``key`` (and ``tag``, when keyed), or -1."""
    cap = t.shape[0]
    i = _home(key, tag, keyed, cap)
    want = np.uint64(tag) + U1
    while t[i, 1]:
        if t[i, 0] == key and (not keyed or t[i, 1] == want):
            return i
        i += 1
        if i == cap:
            i = 0
    return -1


@njit(cache=True, inline="always")
def _insert(t, key, tag, keyed):
    """A free slot for ``key`` (absent), tagged ``tag``; its payload is zero."""
    cap = t.shape[0]
    i = _home(key, tag, keyed, cap)
    while t[i, 1]:
        i += 1
        if i == cap:
            i = 0
    t[i, 0] = key
    t[i, 1] = np.uint64(tag) + U1
    return i


@njit(cache=True, inline="always")
def _delete(t, i, keyed):
    """Free slot ``i``, shifting back the entries after it that probed past it."""
    cap = t.shape[0]
    j = i
    while True:
        j += 1
        if j == cap:
            j = 0
        if not t[j, 1]:
            break
        k = _home(t[j, 0], t[j, 1] - U1, keyed, cap)
        stays = (i < k <= j) if i <= j else (k > i or k <= j)
        if stays:
            continue
        t[i, :] = t[j, :]
        i = j
    t[i, :] = 0


@njit(cache=True)
def rehash(t, new, keyed):
    """Copy every entry into ``new`` (larger, or with wider rows), all empty."""
    width = t.shape[1]
    for i in range(t.shape[0]):
        if t[i, 1]:
            j = _insert(new, t[i, 0], t[i, 1] - U1, keyed)
            new[j, :width] = t[i, :]


@njit(cache=True, inline="always")
def _holds(pool, m, bit):
    return (pool[m, 1 + (bit >> 6)] >> np.uint64(bit & 63)) & U1


@njit(cache=True, inline="always")
def _refs(t, rt, pool, h, bit):
    """``bit``'s packed refs on ``h`` (0: none) and ``h``'s block slot (-1: nobody holds it)."""
    s = _find(t, h, 0, False)
    if s < 0 or not _holds(pool, t[s, 1] >> ID_SHIFT, bit):
        return np.uint64(0), s
    r = _find(rt, h, bit, True)
    return (DEV if r < 0 else rt[r, 2]), s


@njit(cache=True, inline="always")
def _mask_home(words, cap):
    x = np.uint64(0)
    for w in words:
        x = (x ^ w) * _MIX
    return np.int64(((x >> U32) * np.uint64(cap) + (((x & LOW32) * np.uint64(cap)) >> U32)) >> U32)


@njit(cache=True, inline="always")
def _same(pool, m, words):
    for w in range(words.shape[0]):
        if pool[m, 1 + w] != words[w]:
            return False
    return True


@njit(cache=True, inline="always")
def _intern(pool, mtab, free, counts, words):
    """The id of mask ``words`` (one more reference to it), taking a free id for a new one."""
    cap = mtab.shape[0]
    i = _mask_home(words, cap)
    while mtab[i]:
        m = mtab[i]
        if _same(pool, m, words):
            pool[m, 0] += U1
            return m
        i += 1
        if i == cap:
            i = 0
    if counts[3]:
        counts[3] -= 1
        m = free[counts[3]]
    else:
        counts[2] += 1
        m = counts[2]
    pool[m, 1:] = words
    pool[m, 0] = U1
    mtab[i] = m
    return m


@njit(cache=True, inline="always")
def _release(pool, mtab, free, counts, m):
    """One reference fewer to mask ``m``; its id is free once none is left."""
    pool[m, 0] -= U1
    if pool[m, 0]:
        return
    cap = mtab.shape[0]
    i = _mask_home(pool[m, 1:], cap)
    while mtab[i] != m:
        i += 1
        if i == cap:
            i = 0
    j = i
    while True:
        j += 1
        if j == cap:
            j = 0
        if not mtab[j]:
            break
        k = _mask_home(pool[mtab[j], 1:], cap)
        if (i < k <= j) if i <= j else (k > i or k <= j):
            continue
        mtab[i] = mtab[j]
        i = j
    mtab[i] = 0
    free[counts[3]] = m
    counts[3] += 1


@njit(cache=True)
def rebuild_masks(pool, mtab, counts):
    """Index every live mask of ``pool`` in ``mtab`` (all empty): after the pool grew or widened."""
    cap = mtab.shape[0]
    for m in range(1, counts[2] + 1):
        if pool[m, 0]:
            i = _mask_home(pool[m, 1:], cap)
            while mtab[i]:
                i += 1
                if i == cap:
                    i = 0
            mtab[i] = m


@njit(cache=True, inline="always")
def _host_only(v):
    return v != 0 and (v & LOW32) == 0


@njit(cache=True, inline="always")
def _set_refs(t, rt, pool, mtab, free, counts, scratch, bit, h, v):
    """Make ``bit``'s packed refs on ``h`` ``v``; returns the old value. ``scratch``: one mask's words."""
    old, s = _refs(t, rt, pool, h, bit)
    if old == v:
        return old
    if s < 0:
        s = _insert(t, h, 0, False)
        counts[0] += 1
    r = _find(rt, h, bit, True) if old != DEV and old != 0 else -1
    if v == DEV or v == 0:
        if r >= 0:
            _delete(rt, r, True)
            counts[1] -= 1
    else:
        if r < 0:
            r = _insert(rt, h, bit, True)
            counts[1] += 1
        rt[r, 2] = v
    host_change = np.int64(_host_only(v)) - np.int64(_host_only(old))
    t[s, 1] = np.uint64(np.int64(t[s, 1]) + host_change)
    counts[FIXED_COUNTS + 1 + 2 * bit] += host_change
    if old != 0 and v != 0:
        return old
    m = t[s, 1] >> ID_SHIFT
    held = False
    for w in range(scratch.shape[0]):   # plain loops: a slice of ``pool`` would be an array to count references to
        scratch[w] = pool[m, 1 + w]
        if w == bit >> 6:
            scratch[w] ^= U1 << np.uint64(bit & 63)
        held = held or scratch[w] != 0
    counts[FIXED_COUNTS + 2 * bit] += 1 if old == 0 else -1
    if m:
        _release(pool, mtab, free, counts, m)
    if held:
        t[s, 1] = (np.uint64(_intern(pool, mtab, free, counts, scratch)) << ID_SHIFT) | (t[s, 1] & HOST_BITS)
    else:
        _delete(t, s, False)
        counts[0] -= 1
    return old


@njit(cache=True)
def set_all(t, rt, pool, mtab, free, counts, bit, hs, vs):
    """``_set_refs`` of each pair, in order (a snapshot installed, a purge)."""
    scratch = np.zeros(pool.shape[1] - 1, np.uint64)
    for k in range(hs.shape[0]):
        _set_refs(t, rt, pool, mtab, free, counts, scratch, bit, hs[k], vs[k])


@njit(cache=True)
def held(t, rt, pool, bit, out_h, out_v, start):
    """Write ``bit``'s ``(hash, refs)`` pairs into ``out_h``/``out_v`` from ``start``; returns the end."""
    n = start
    for i in range(t.shape[0]):
        if t[i, 1] and _holds(pool, t[i, 1] >> ID_SHIFT, bit):
            h = t[i, 0]
            r = _find(rt, h, bit, True)
            out_h[n] = h
            out_v[n] = DEV if r < 0 else rt[r, 2]
            n += 1
    return n


@njit(cache=True, inline="always")
def _held_on(v, unit):
    return (v >> U32) != 0 if unit == HOST else (v & LOW32) != 0


@njit(cache=True)
def apply_ops(t, rt, pool, mtab, free, counts, bit, ops, hs, log_h, log_v):
    """Apply a batch's ops (``OP_FIELDS`` ints each) for ``bit``, all or none. Returns ``(-1, 0, 0)``, or, for a
    removal or move of a block not held on that tier (everything undone): ``(event index, hash, unit)``."""
    n_log = 0
    p = 0
    scratch = np.zeros(pool.shape[1] - 1, np.uint64)
    for o in range(ops.shape[0] // OP_FIELDS):
        f = o * OP_FIELDS
        kind, n, event = ops[f], ops[f + 3], ops[f + 4]
        unit, new_unit = np.uint64(ops[f + 1]), np.uint64(ops[f + 2])
        if kind == CLEAR:
            start = n_log
            n_log = held(t, rt, pool, bit, log_h, log_v, start)
            for e in range(start, n_log):
                _set_refs(t, rt, pool, mtab, free, counts, scratch, bit, log_h[e], np.uint64(0))
        for k in range(p, p + n):
            h = hs[k]
            v, _ = _refs(t, rt, pool, h, bit)
            if kind == STORE:
                w = v + unit
            elif _held_on(v, unit):
                w = v - unit + (new_unit if kind == MOVE else np.uint64(0))
            else:
                for e in range(n_log - 1, -1, -1):
                    _set_refs(t, rt, pool, mtab, free, counts, scratch, bit, log_h[e], log_v[e])
                return event, h, unit
            log_h[n_log] = h
            log_v[n_log] = _set_refs(t, rt, pool, mtab, free, counts, scratch, bit, h, w)
            n_log += 1
        p += n
    return -1, np.uint64(0), np.uint64(0)


@njit(cache=True, inline="always")
def _bit_index(low):
    """The position of the single set bit ``low``."""
    b = 0
    while low > U1:
        low >>= U1
        b += 1
    return b


@njit(cache=True)
def match_walk(t, rt, pool, bit_rank, q, out, slots):
    """Per bit holding ``q[0]``: its held prefix of ``q`` and the host-only blocks within it. Writes, in order of
    (blocks, bit), ``out[0]`` the bits, ``out[1]`` their ranks (``bit_rank``), ``out[2]`` the blocks and
    ``out[3]`` the host-only blocks; then the runs of one answer, ``out[4]`` their lengths, ``out[5]`` their
    blocks, ``out[6]`` their host-only blocks. Returns (ranks, runs). One lookup per block, and per-bit work
    only where the holders' mask changes; ``slots`` is scratch (one per block)."""
    n = q.shape[0]
    words = pool.shape[1] - 1
    held = n
    for j in range(n):   # the lookups first, independent of each other, so their cache misses overlap
        s = _find(t, q[j], 0, False)
        if s < 0:
            held = j
            break
        slots[j] = s
    if not held:
        return 0, 0
    prev = t[slots[0], 1] >> ID_SHIFT
    active = pool[prev, 1:].copy()
    k = 0
    end = n
    for j in range(1, n + 1):
        m = t[slots[j], 1] >> ID_SHIFT if j < held else np.uint64(0)   # id 0: the empty mask
        if j < n and m == prev:
            continue
        left = False
        for w in range(words):
            lost = active[w] & ~pool[m, 1 + w]
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
        prev = m
    out[3, :k] = 0
    for j in range(end):
        s = slots[j]
        if t[s, 1] & HOST_BITS == U1:   # nobody holds it on the host tier only
            continue
        for i in range(k):
            if out[2, i] > j:
                r = _find(rt, q[j], out[0, i], True)
                if r >= 0 and _host_only(rt[r, 2]):
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
def refs_of(t, rt, pool, bit, hs, out):
    """``bit``'s packed refs on each of ``hs`` into ``out`` (0: not held)."""
    for i in range(hs.shape[0]):
        out[i] = _refs(t, rt, pool, hs[i], bit)[0]
