"""FineTuner: one AdamW step per batch on the client's trainable parameters (a LoRA adapter run by the peers,
prompt embeddings prepended on the client, or those plus per-block prompts the peers add: deep prompt tuning),
through a DistributedModelForCausalLM whose own weights stay frozen; and `exact_match`, the greedy answers' score
on prompt/completion examples. Used by `swarm finetune` and benchmarks/finetune.py.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from swarm.client.deep_prompts import DeepPromptTuning
from swarm.client.lora import LoraAdapter, LoraConfig
from swarm.client.prompts import PromptTuning
from swarm.finetune.data import Batch, Example, collate, encode


class FineTuner:
    """Trains `method` ("lora", "ptune" or "deep_ptune") on `model` (a DistributedModelForCausalLM, or any
    transformers causal LM for shallow prompt tuning); `init_dir` starts from a saved adapter, not a fresh one."""

    def __init__(
        self,
        model: nn.Module,
        method: str,
        lora: LoraConfig | None = None,
        prompt_tokens: int = 16,
        lr: float = 1e-3,
        weight_decay: float = 0.0,
        init_dir: Path | None = None,
    ) -> None:
        self.model, self.method = model.requires_grad_(False), method
        if method == "lora":
            adapter = (
                LoraAdapter.from_pretrained(model, init_dir)
                if init_dir
                else LoraAdapter.for_model(model, lora or LoraConfig())
            )
            model.blocks.adapter = adapter
            self.trainable: nn.Module = adapter
        else:
            kind = DeepPromptTuning if method == "deep_ptune" else PromptTuning
            vocab = model.get_input_embeddings().num_embeddings
            prompts = kind.from_pretrained(init_dir) if init_dir else None
            self.trainable = prompts or kind.from_vocabulary(model, torch.randint(0, vocab, (prompt_tokens,)))
            if method == "deep_ptune":
                self.trainable.attach(model)
        self.optimizer = torch.optim.AdamW(self.trainable.parameters(), lr=lr, weight_decay=weight_decay)

    def logits_and_loss(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits [batch, seq, vocab] of the batch's own positions and the mean loss over its labels."""
        if self.method == "lora":
            out = self.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, labels=batch.labels)
            return out.logits, out.loss
        kwargs = self.trainable.inputs(self.model, batch.input_ids, batch.labels, batch.attention_mask)
        out = self.model(**kwargs)
        return out.logits[:, self.trainable.num_tokens :], out.loss

    def step(self, batch: Batch) -> float:
        """One optimizer step on `batch`; returns its loss before the step."""
        self.optimizer.zero_grad()
        _, loss = self.logits_and_loss(batch)
        loss.backward()
        self.optimizer.step()
        return loss.item()

    def save(self, directory: Path, base_model: str = "") -> None:
        self.trainable.save_pretrained(directory, base_model=base_model)

    def close(self) -> None:
        if self.method == "lora":
            self.model.blocks.adapter = None
        elif self.method == "deep_ptune":
            DeepPromptTuning.detach_from(self.model)

    @torch.no_grad()
    def exact_match(self, tokenizer, examples: list[Example], batch_size: int = 16, max_length: int = 128) -> float:
        """Share of prompt/completion examples whose greedy answer is exactly the completion (and EOS). Teacher
        forcing gives the same verdict as greedy generation: every greedy token equals the completion's exactly
        when the argmax at each completion position, given the completion so far, is its next token."""
        hits = 0
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
        for start in range(0, len(examples), batch_size):
            rows = [encode(tokenizer, e, max_length) for e in examples[start : start + batch_size]]
            batch = collate(rows, pad)
            logits, _ = self.logits_and_loss(batch)
            predicted = logits[:, :-1].argmax(-1)
            target, scored = batch.labels[:, 1:], batch.labels[:, 1:] != -100
            hits += int(((predicted == target) | ~scored).all(dim=1).sum())
        return hits / len(examples)
