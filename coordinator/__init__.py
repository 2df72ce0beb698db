"""The cluster: rank actors, rendezvous, agreed block counts, health, KV migration.

Importing it sets nothing: ``ray_env.configure`` sets the Ray environment, called by whatever starts or joins a
cluster.
"""
