"""gRPC's fork handlers off, for every process that imports RaySwarm, before gRPC is first imported.

hivemind forks its DHT node (and its averagers) from processes that serve and call gRPC on many threads. gRPC's core
installs at-fork handlers by default; when a fork comes while other threads are inside gRPC it skips its own but the
child can still run gRPC's event-engine handlers over mutexes those threads held waiters on. The child then dies of
a SIGABRT at once ("Check w->waitp->cv_word == nullptr failed: Mutex::Fer"): seen about once per full test run, and
in one CI run three forks in a row, so a client could not join the swarm. No forked child of ours calls gRPC (the DHT
speaks libp2p through p2pd), so the handlers buy nothing here. gRPC reads the variable once, when it is imported:
set later it does nothing (measured), which is why `swarm/__init__.py` imports this module first. An operator's own
setting wins. Ray's processes started from here inherit it.
"""

from __future__ import annotations

import os

os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
