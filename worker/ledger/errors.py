"""Errors callers of the ledger are expected to handle."""


class OutOfBlocksError(RuntimeError):
    """The primary tier cannot supply the blocks asked for; the ledger is unchanged."""

    def __init__(self, needed: int, available: int, what: str) -> None:
        super().__init__(f"{what}: needs {needed} free primary blocks, {available} available")
        self.needed = needed
        self.available = available
