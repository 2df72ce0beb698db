"""The cluster: rank actors, rendezvous, agreed block counts, health, KV migration.

Importing this package sets (where unset) the environment every process of a
kvledger Ray cluster shares; Ray reads ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`` when it
is first imported, so this must happen before ``import ray`` (see ``ray_env``).
"""
from kvledger.coordinator.ray_env import ray_env_vars

ray_env_vars()
