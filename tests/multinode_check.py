"""Run as a script (its own Ray): ranks spread over simulated nodes of ``ray.cluster_utils.Cluster``.

Prints one JSON line with what it saw; ``test_cluster_multinode.py`` runs it in a
subprocess because a test session holds one Ray already.
"""
from __future__ import annotations

import json
import sys

import torch


def main() -> int:
    from kvledger.coordinator.ray_env import configure, ensure_auth_token, init_ray
    configure()   # before ray is imported

    import ray
    from ray.cluster_utils import Cluster as RayCluster

    from kvledger.coordinator.cluster import Cluster
    from kvledger.coordinator.config import ClusterConfig
    from kvledger.worker.ledger import CacheConfig
    from kvledger.worker.wire.request import Request

    ensure_auth_token()   # token auth on: every simulated node reads this machine's token, as a real one would
    node_args = {"num_cpus": 1, "node_ip_address": "127.0.0.1", "include_dashboard": False,
                 "object_store_memory": 80 * 1024 * 1024}
    sim = RayCluster(initialize_head=True, head_node_args={**node_args, "num_cpus": 0})
    try:
        for _ in range(2):
            sim.add_node(**node_args)
        sim.wait_for_nodes(timeout=60)
        init_ray(address=sim.address, ship_code=True, log_to_driver=False)  # code travels by py_modules
        cache = CacheConfig(tokens_per_block=4, num_layers=1, num_kv_heads=1, head_dim=8, dtype=torch.float32,
                            device="cpu", num_primary_blocks=32)
        c = Cluster.start(ClusterConfig(num_ranks=2, device="cpu", cache=cache, group_timeout_s=30,
                                        call_timeout_s=60))
        nodes = [ray.get(a.node_id.remote(), timeout=30) for a in c.actors]
        strategy = ray.util.placement_group_table(c.placement)["strategy"]
        p = list(range(30, 30 + 13))
        (scratch,) = c.client(0).serve([Request(1, p)], logits=True).outcomes
        m = c.migrator.migrate(p, 0, 1)
        (moved,) = c.client(1).serve([Request(2, p)], logits=True).outcomes
        same = bool(torch.allclose(torch.tensor(scratch.last_logits), torch.tensor(moved.last_logits), atol=1e-4))
        code = [ray.get(a.code_path.remote(), timeout=30) for a in c.actors]
        out = {"nodes": nodes, "alive_nodes": len([n for n in ray.nodes() if n["Alive"]]), "strategy": strategy,
               "sent_blocks": m.sent_blocks, "cached_on_target": moved.cached_tokens, "same_logits": same,
               "code_paths": code,
               "block_counts": list(c.block_counts)}
        c.shutdown()
        ray.shutdown()
    finally:
        sim.shutdown()
    print("RESULT " + json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
