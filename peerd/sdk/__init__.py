"""What local programs use to talk to a daemon: Client and AsyncClient over the local API socket,
the transformers-compatible AutoDistributedModelForCausalLM, and the terminal chat and status.

The clients are one source: async_client.py (AsyncClient) is written by hand and sync_client.py
generated from it by unasync.py; transport.py holds their one difference (anyio against a
blocking socket), options.py and replies.py what they send and check. The model is model.py on
top of remote.py (the daemon connection, the remote KV cache, training passes) and
model_checks.py.

Importable without libp2p: may import wire, blocks (the model's client-side pieces) and
peerd.paths; never node, server, session or daemon. `peerd.client` and `peerd.model` re-export it.
"""
