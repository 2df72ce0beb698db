"""The cluster: rank actors, rendezvous, agreed block counts, health, KV migration."""
