"""Build the parts of a model that one process holds, from a Hugging Face checkpoint directory.

checkpoint.py: selective safetensors reads; config.py: open a checkpoint, refuse unsupported architectures;
llama.py: Llama-family blocks (the one adapter so far); span.py: BlockSpan [start, end) and its SpanCache;
client_head.py: embeddings, final norm and LM head; gguf.py: convert a GGUF file to a float checkpoint.
"""

from __future__ import annotations

from swarm.partition.checkpoint import Checkpoint
from swarm.partition.client_head import ClientHead, load_client_head
from swarm.partition.config import open_checkpoint
from swarm.partition.llama import BlockConfig
from swarm.partition.span import BlockSpan, SpanCache, load_span

__all__ = [
    "BlockConfig",
    "BlockSpan",
    "Checkpoint",
    "ClientHead",
    "SpanCache",
    "load_client_head",
    "load_span",
    "open_checkpoint",
]
