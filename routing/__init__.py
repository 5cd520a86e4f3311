"""Swarm knowledge: server records, block selection, route planning, bans and RTTs.

Pure and network-free; docs/routing.md says how the pieces decide. May import wire and blocks,
never peerd.
"""
