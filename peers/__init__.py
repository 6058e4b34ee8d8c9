"""The peer daemon: hosts a span of blocks in a Ray actor, serves it over gRPC, announces it in the DHT.

config.py: PeerConfig; daemon.py: PeerDaemon (DHT membership, drain); actor.py: StagePeer (the Ray actor);
stage_handle.py: the stage in a Ray actor or in this process, behind one handle; server.py: PeerServer (gRPC server +
health); serving_loop.py: the asyncio loop the servers' streams run on; service.py: the Peer servicer (decode,
validate, call, encode); chunked_streams.py: ForwardStream/BackwardStream chunks; rpc_handlers.py: its
registration, with lenient request parsing; rpc_status.py: the one error table applied to every handler; limits.py:
per-client admission (sessions, request rate, tokens, bytes); push.py: session inboxes, their push fence and the push
to the next peer; push_targets.py: the next peers it may push to. Batched inference (issue 37): session_streams.py:
the `Sessions` stream (many sessions of one client, stepped together); stream_records.py: what it keeps per session
and step; step_batches.py: a batch's tensor cut per
step, chunked batches, AnswerBatch and SessionError messages; push_batch.py: PushBatch's delivery into the streams.
The token path below the service: engine.py: the loop (schedule, run, complete futures), its lock, tensors and
futures; scheduler.py: the sessions and their pages (admission, preemption, beams, idle closes) and what runs next
(token budget, chunking, forward batching); engine_records.py: what they keep per session and step; futures.py:
futures callers cannot cancel; rates.py: the engine's moving rates; prefix_attach.py: sessions that start from
cached pages and index theirs; prefix_cache.py: the prefix cache's index and its evictable pages; model_runner.py:
one ragged batch per iteration through the span; paged_attention.py: attention over the pages; kv_cache.py: the page
pool and page tables; task_runner.py: forward and backward tasks on tensors.
Adapters: lora.py: LoRA deltas on a span's linear layers and the uploads' cache; adapter_service.py: LoadAdapter;
adapter_budget.py: bytes of uploads per uploader; served_adapters.py: named adapters for inference sessions.
metrics.py: Prometheus; placement.py: which blocks to take and whether to move; memory.py: how many blocks fit;
rebalance.py: the periodic move check; launch.py: Ray; local_swarm.py: the embedded default (`swarm up`);
training/: SWARM training stages.

The names below are imported on first use: a training stage (peers.training) starts without the inference server's
modules, and a restarted stage replica is serving seconds sooner.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "PeerConfig": "peers.config",
    "PeerDaemon": "peers.daemon",
    "LocalSwarm": "peers.local_swarm",
    "PeerServer": "peers.server",
    "ServerConfig": "peers.config",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'peers' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
