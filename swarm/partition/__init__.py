"""Build the parts of a model that one process holds, from a Hugging Face checkpoint directory.

architecture.py: the seam for a model family (Architecture, BlockConfig, the model_type registry FAMILIES);
one module per family: llama.py (Llama, Mistral, Qwen2), qwen3.py, mixtral.py (sparse MoE), phi3.py (fused tensors),
gemma2.py (soft-capped scores and logits, scaled embeddings, sequences within the sliding window);
layers.py: RMSNorm, rotary tables, KVLayer, ScoreRule and causal attention, shared by the families;
checkpoint.py: selective safetensors reads; config.py: open a checkpoint, refuse unsupported architectures;
config_cache.py: transformers' reading of a config.json, kept on disk so that later processes skip transformers;
portable.py: PortableConfig, a model config that unpickles without transformers;
span.py: BlockSpan [start, end) and its SpanCache; client_head.py: embeddings, final norm and LM head;
gguf.py: convert a GGUF file to a float checkpoint; lora.py: a LoRA adapter's format (LoraConfig, peft's names),
shared by the client and the peers; quantize.py: int8 / nf4 block weights (bitsandbytes) and the
memory plan; int8_linear.py: LLM.int8 weights computed the way their device does it best.
"""

from __future__ import annotations

from swarm.partition.architecture import Architecture, BlockConfig, architecture_of
from swarm.partition.checkpoint import Checkpoint
from swarm.partition.client_head import ClientHead, load_client_head
from swarm.partition.config import PortableConfig, open_checkpoint
from swarm.partition.config_cache import hf_config_of
from swarm.partition.span import BlockSpan, SpanCache, load_span

__all__ = [
    "Architecture",
    "BlockConfig",
    "BlockSpan",
    "Checkpoint",
    "ClientHead",
    "PortableConfig",
    "SpanCache",
    "architecture_of",
    "hf_config_of",
    "load_client_head",
    "load_span",
    "open_checkpoint",
]
