"""Rigs for trying and testing a swarm on one machine: local swarms of real daemon processes,
`peerd demo`, a small internet of Linux network namespaces with NAT, and WAN delay emulation.

May import session, node, wire, blocks and routing; never server, daemon, sdk or gateway (daemons
are started as processes, through the command line).
"""
