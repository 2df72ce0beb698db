"""The rank runtime: a ledger and the reference engine behind one lock, its process group, its transfers, its events."""
