"""The block server: serves one span of a model to any peer over the info, inference, push and
training protocols; admission (who may open a session, who waits for cache), batching of steps of
different sessions into one forward, and the compute queue of a device.

May import node (streams, protocols), wire, blocks and routing (its own record); never session,
daemon, sdk or gateway: a server knows nothing of the clients that use it.
"""
