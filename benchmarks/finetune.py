"""Fine-tuning benchmark: LoRA through the swarm (default 8-bit codec) against local peft training of the same
adapter on the same batches, in the same run.

Run: `python -m benchmarks.finetune --model .cache/models/smollm2-135m [--steps 30]`. Two in-process peers on
127.0.0.1 serve blocks [0, 15) and [15, 30) of SmolLM2; the task is tests/data/finetune_tags.jsonl (answer in a fixed
format). Prints one JSON object: samples/s swarm and local and their ratio, bytes per step on the wire (hidden states
both ways as the peers count them, adapter uploads, adapter gradients), final losses (the loss over the whole dataset
after training), `loss_gap` (swarm final loss / local - 1) and `exact_match_before` / `exact_match_after` (greedy
answers through the swarm with the adapter).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

DATASET = Path(__file__).resolve().parent.parent / "tests" / "data" / "finetune_tags.jsonl"


def train_local(path: Path, init: Path, data: list, lr: float) -> tuple[object, float]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    model = PeftModel.from_pretrained(base, init, is_trainable=True)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    started = time.perf_counter()
    for batch in data:
        optimizer.zero_grad()
        model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, labels=batch.labels).loss.backward()
        optimizer.step()
    return model, time.perf_counter() - started


def local_run(ns: argparse.Namespace, tokenizer, examples: list, data: list, tmp: Path) -> tuple:
    """Save a fresh peft adapter (the swarm starts from it too), train it locally; (seconds, final loss, batch)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from swarm.finetune.data import collate, encode

    base = AutoModelForCausalLM.from_pretrained(str(ns.model), dtype=torch.float32)
    config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    get_peft_model(base, config).save_pretrained(tmp / "init")
    local, local_s = train_local(ns.model, tmp / "init", data, ns.lr)
    everything = collate([encode(tokenizer, e, 64) for e in examples], tokenizer.eos_token_id or 0)
    with torch.no_grad():
        kwargs = {"attention_mask": everything.attention_mask, "labels": everything.labels}
        return local_s, local(input_ids=everything.input_ids, **kwargs).loss.item(), everything


def wire_bytes(servers: list) -> float:
    counter = [s.metrics.bytes.labels(direction=d, kind="wire") for s in servers for d in ("in", "out")]
    return sum(c._value.get() for c in counter)  # prometheus_client keeps no public read of a counter


def measure(ns: argparse.Namespace, registry, servers: list, tmp: Path) -> dict:
    from transformers import AutoTokenizer

    from swarm import DistributedModelForCausalLM
    from swarm.finetune import FineTuner, load_examples
    from swarm.finetune.data import batches
    from swarm.security import SwarmCredentials

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(str(ns.model))
    examples = load_examples(ns.dataset)
    stream = batches(tokenizer, examples, ns.batch_size, 64, seed=0)
    data = [next(stream) for _ in range(ns.steps)]
    local_s, local_loss, everything = local_run(ns, tokenizer, examples, data, tmp)

    model = DistributedModelForCausalLM.from_pretrained(
        ns.model, registry.addresses, credentials=SwarmCredentials.open()
    )
    try:
        tuner = FineTuner(model, "lora", lr=ns.lr, init_dir=tmp / "init")
        before = tuner.exact_match(tokenizer, examples)
        tuner.step(data[0])  # warm-up: routes, connections (not timed; the same batch is trained again below)
        tuner = FineTuner(model, "lora", lr=ns.lr, init_dir=tmp / "init")
        hidden_before, uploads_before = wire_bytes(servers), model.blocks.uploads.bytes_sent
        started = time.perf_counter()
        for batch in data:
            tuner.step(batch)
        swarm_s = time.perf_counter() - started
        hidden = (wire_bytes(servers) - hidden_before) / ns.steps
        uploads = (model.blocks.uploads.bytes_sent - uploads_before) / ns.steps
        with torch.no_grad():
            _, swarm_loss = tuner.logits_and_loss(everything)
        after = tuner.exact_match(tokenizer, examples)
        adapter_floats = sum(p.numel() for p in tuner.trainable.parameters())
    finally:
        model.close()
    samples = ns.steps * ns.batch_size
    return {
        "benchmark": "finetune",
        "method": "lora r=8 q_proj,v_proj",
        "steps": ns.steps,
        "batch_size": ns.batch_size,
        "swarm_samples_per_s": round(samples / swarm_s, 3),
        "local_peft_samples_per_s": round(samples / local_s, 3),
        "ratio_swarm_to_local": round(local_s / swarm_s, 3),
        "hidden_bytes_per_step": round(hidden),
        "adapter_upload_bytes_per_step": round(uploads),
        "adapter_grad_bytes_per_step": adapter_floats * 4,  # CODEC_NONE float32, one copy per step
        "swarm_final_loss": round(swarm_loss.item(), 5),
        "local_final_loss": round(local_loss, 5),
        "loss_gap": round(swarm_loss.item() / local_loss - 1, 5),
        "exact_match_before": before,
        "exact_match_after": after,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=Path(".cache/models/smollm2-135m"))
    parser.add_argument("--dataset", type=Path, default=DATASET)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    ns = parser.parse_args()

    from benchmarks.two_peers import two_peers
    from peers.server import ServerConfig
    from swarm.security import SwarmCredentials

    config = ServerConfig(
        cache_tokens=1024, max_session_length=256, max_request_tokens=4096, credentials=SwarmCredentials.open()
    )
    with two_peers(ns.model, config=config) as (registry, servers), tempfile.TemporaryDirectory() as tmp:
        print(json.dumps(measure(ns, registry, servers, Path(tmp))), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
