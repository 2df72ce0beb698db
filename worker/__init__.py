"""One rank of a kvledger cluster, in four rooms.

``wire`` is what crosses a process (events, block hashes, numbered batches,
router-to-rank messages; msgpack only, no torch), ``ledger`` the rank's books,
``engine`` the reference model that serves through them, ``rank`` the runtime
around both (process group, transfers, serving, publishing, the Ray actor).
Nothing is imported here, so ``import kvledger.worker.wire`` stays torch-free.
"""
