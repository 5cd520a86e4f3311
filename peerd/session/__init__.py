"""The client side of a swarm: the swarm view (who serves which blocks), inference and training
sessions over a route of servers with failover and replay, spot-check verification, token
generation (prefill, decode, sample) and the leeching node for programs that do not serve.

May import node, wire, blocks and routing; never server (our own server is reached through the
protocols in session.local), daemon, sdk or gateway.
"""
