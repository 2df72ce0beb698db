"""Placement across nodes: a simulated multi-node Ray (``ray.cluster_utils.Cluster``) in a subprocess."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from processes import run

HERE = Path(__file__).parents[1]   # tests/, where multinode_check.py lives


def test_ranks_spread_over_nodes_and_migrate_between_them():
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
           "PYTHONPATH": os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")])}
    # its own session: on a timeout the simulated nodes' Ray processes die with it (see processes.py)
    proc = run([sys.executable, str(HERE / "multinode_check.py")], timeout=170, env=env, cwd=HERE.parent)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads(lines[-1][len("RESULT "):])
    assert out["alive_nodes"] == 3 and out["strategy"] == "SPREAD"
    assert len(set(out["nodes"])) == 2, "the two ranks sit on different nodes"
    assert out["sent_blocks"] == 3 and out["cached_on_target"] == 12 and out["same_logits"]
    assert out["block_counts"] == [32, 0]
    here = str(HERE.parent / "worker")
    assert all(path != here and "runtime_resources" in path for path in out["code_paths"]), \
        f"the ranks imported kvledger from {out['code_paths']}, not from the package shipped to their node"
