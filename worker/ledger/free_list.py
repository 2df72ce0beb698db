"""Intrusive doubly linked list of blocks: O(1) append, pop and removal, no allocation per operation."""
from __future__ import annotations

from collections.abc import Iterator

from kvledger.worker.ledger.block import Block


class FreeList:
    """Blocks in eviction order: the head is the next victim, the tail the most recently freed."""

    __slots__ = ("_head", "size")

    def __init__(self) -> None:
        self._head = Block(block_id=-1, slot=-1, tier=-1)  # sentinel: head.fl_next is first, head.fl_prev last
        self._head.fl_next = self._head.fl_prev = self._head
        self.size = 0

    def append(self, block: Block) -> None:
        last = self._head.fl_prev
        block.fl_prev, block.fl_next = last, self._head
        last.fl_next = self._head.fl_prev = block
        self.size += 1

    def appendleft(self, block: Block) -> None:
        first = self._head.fl_next
        block.fl_prev, block.fl_next = self._head, first
        first.fl_prev = self._head.fl_next = block
        self.size += 1

    def popleft(self) -> Block:
        """Take the first block out (the list is not empty)."""
        head = self._head
        b = head.fl_next
        head.fl_next = nxt = b.fl_next
        nxt.fl_prev = head
        b.fl_prev = b.fl_next = None
        self.size -= 1
        return b

    def remove(self, block: Block) -> None:
        block.fl_prev.fl_next = block.fl_next
        block.fl_next.fl_prev = block.fl_prev
        block.fl_prev = block.fl_next = None
        self.size -= 1

    @property
    def sentinel(self) -> Block:
        """The list's own head block (no real block): ``sentinel.fl_next`` is the first, ``fl_prev`` the last."""
        return self._head

    def first(self) -> Block | None:
        b = self._head.fl_next
        return None if b is self._head else b

    def __iter__(self) -> Iterator[Block]:
        b = self._head.fl_next
        while b is not self._head:
            nxt = b.fl_next
            yield b
            b = nxt

    def __len__(self) -> int:
        return self.size
