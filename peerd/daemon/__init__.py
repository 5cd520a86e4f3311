"""The daemon process: one trio process that owns the node, the block server and the swarm view,
answers the local API on a Unix socket, exposes metrics, and installs itself as a systemd unit.

May import node, server, session, wire, blocks and routing; never sdk or gateway (local programs
reach it only through the socket).
"""
