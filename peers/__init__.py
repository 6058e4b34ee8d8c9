"""The peer daemon: hosts a span of blocks in a Ray actor and serves it over gRPC (see DESIGN.md, issue 3).

Its building blocks live in `swarm` today: `swarm.partition` builds the span a peer serves, `swarm.codec` encodes
what it sends, and `proto/swarm.proto` defines the service it will implement.
"""
