"""What local programs use to talk to a daemon: Client and AsyncClient over the local API socket,
the transformers-compatible AutoDistributedModelForCausalLM, and the terminal chat and status.

Importable without libp2p: may import wire, blocks (the model's client-side pieces) and
peerd.paths; never node, server, session or daemon. `peerd.client` and `peerd.model` re-export it.
"""
