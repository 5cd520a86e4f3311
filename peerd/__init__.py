"""peerd: run a large language model across a swarm of volunteer machines."""

__version__ = "0.1.0"
