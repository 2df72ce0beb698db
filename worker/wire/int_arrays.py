"""A compiled check of raw msgpack arrays of non-negative ints: the token ids of ``decode_view``.

The router's index never reads a block's token ids, but a batch that carries
bad ones must still be refused, as ``decode_batch`` refuses it. Building them
into a list of Python ints only to check them cost half of the router's apply,
so the view leaves them as msgpack and this loop walks their bytes instead:
an array header, then each item's type byte (and, for the signed formats, its
sign bit). msgspec has already checked that each piece is one well-formed
msgpack value; this decides only whether it is what ``list[int >= 0]`` would
decode. Compiled on first call and cached on disk (``cache=True``); the events
module imports it only when the router decodes, so a worker never loads numba.
"""
from __future__ import annotations

import numpy as np
from numba import njit

_UINT8, _UINT64, _INT8, _INT64 = 0xCC, 0xCF, 0xD0, 0xD3   # the int formats past fixint, by width 1, 2, 4, 8 bytes


@njit(cache=True, inline="always")
def _skip_run(buf, i, n, left, tag, width):
    """Past the items tagged ``tag`` (``width`` bytes each) from ``i`` on, at most ``left`` of them. The next
    offset depends on no load, so the loads overlap: a token array is mostly one width (uint16 for a vocabulary
    under 65,536), and walking it item by item, each offset read from the last, was three times slower."""
    while left > 0 and i < n and buf[i] == tag:
        i += width
        left -= 1
    return i, left


@njit(cache=True)
def _all_non_negative(buf, count):
    n = buf.shape[0]
    i = 0
    for _ in range(count):
        if i >= n:
            return False
        head = np.int64(buf[i])
        if 0x90 <= head <= 0x9F:   # fixarray
            left = head & 0x0F
            i += 1
        elif head == 0xDC and i + 3 <= n:   # array 16
            left = (np.int64(buf[i + 1]) << 8) | np.int64(buf[i + 2])
            i += 3
        elif head == 0xDD and i + 5 <= n:   # array 32
            left = ((np.int64(buf[i + 1]) << 24) | (np.int64(buf[i + 2]) << 16)
                    | (np.int64(buf[i + 3]) << 8) | np.int64(buf[i + 4]))
            i += 5
        else:
            return False
        while left > 0:
            if i >= n:
                return False
            t = np.int64(buf[i])
            if t <= 0x7F:   # positive fixint
                i += 1
                left -= 1
            elif _UINT8 <= t <= _UINT64:
                i, left = _skip_run(buf, i, n, left, t, 1 + (1 << (t - _UINT8)))
            elif _INT8 <= t <= _INT64 and i + 1 < n and buf[i + 1] < 0x80:   # signed, its top bit clear
                i += 1 + (1 << (t - _INT8))
                left -= 1
            else:
                return False
    return i == n


def all_non_negative_int_arrays(raw: bytes, count: int) -> bool:
    """Whether ``raw`` is exactly ``count`` msgpack arrays, back to back, each of non-negative ints."""
    return bool(_all_non_negative(np.frombuffer(raw, np.uint8), count))
