"""peerd: run a large language model across a swarm of volunteer machines."""

import os

__version__ = "0.1.0"

# How long torch's OpenMP threads (GNU libgomp) spin after a parallel region before they sleep,
# in spin iterations; read once, when torch loads libgomp, so it is set here, before any of peerd
# imports torch. Left to libgomp, a daemon's 2-thread forwards ran at the pace of one thread on
# a 2-core machine shared with other processes: every one of a forward's hundreds of regions
# paid a sleep and a wake-up of its workers. 20000 iterations (tens of microseconds) bridges the
# gaps inside a forward and leaves the cores to others between forwards (docs/swarm.md, "One
# compute thread"). A value set in the environment is kept.
os.environ.setdefault("GOMP_SPINCOUNT", "20000")
