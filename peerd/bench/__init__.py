"""`peerd bench ...`: benchmarks that report distributed speed as a ratio of one-process speed,
measured side by side in one run (wire codecs, one span, a local swarm, a WAN, batching, a soak),
and the security review's attacks against a live swarm (attack).

May import devtools, session, sdk, node, wire, blocks and routing; never server or daemon (the
daemons it measures run as processes).
"""
