"""The NATS / JetStream adapter: streams, appends, replay, RPC, KV, and the embedded server.

An in-memory implementation of the same ``Bus`` protocol serves unit tests of
pure logic and the simulator; everything else runs against a real nats-server.
"""
