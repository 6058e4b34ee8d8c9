"""swarm/client/lora.py: an adapter saved in peft's format loads into peft (and back) with the same tensors, its
version moves with every optimizer step, and adapters peers cannot compute are refused by name."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from swarm.client.lora import LoraAdapter, LoraConfig
from swarm.errors import InvalidArgument


@pytest.fixture(scope="module")
def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    return LlamaForCausalLM(config).eval()


def test_peft_format_round_trip(tiny_llama, tmp_path) -> None:
    from peft import LoraConfig as PeftLoraConfig
    from peft import PeftModel, get_peft_model

    adapter = LoraAdapter.for_model(tiny_llama, LoraConfig(rank=4, alpha=8, targets=("q_proj", "down_proj")))
    with torch.no_grad():
        for p in adapter.parameters():
            p.normal_()
    adapter.save_pretrained(tmp_path / "ours")
    loaded = PeftModel.from_pretrained(tiny_llama, tmp_path / "ours")
    state = loaded.state_dict()
    for name, tensor in adapter.named().items():
        assert torch.equal(state[f"base_model.model.model.layers.{name}.default.weight"], tensor)
    loaded.unload()

    peft_model = get_peft_model(LlamaForCausalLM(tiny_llama.config), PeftLoraConfig(r=2, target_modules=["v_proj"]))
    peft_model.save_pretrained(tmp_path / "peft")
    back = LoraAdapter.from_pretrained(tiny_llama, tmp_path / "peft")
    assert back.config == LoraConfig(rank=2, alpha=8.0, targets=("v_proj",))
    assert len(back.names) == 2 * 2


def test_version_moves_with_each_optimizer_step(tiny_llama) -> None:
    adapter = LoraAdapter.for_model(tiny_llama, LoraConfig(rank=2))
    optimizer = torch.optim.AdamW(adapter.parameters(), lr=0.1)
    versions = [adapter.version]
    for _ in range(2):
        sum(p.sum() for p in adapter.parameters()).backward()
        optimizer.step()
        versions.append(adapter.version)
    assert versions[0] < versions[1] < versions[2]


def test_adapters_peers_do_not_compute_are_refused(tiny_llama, tmp_path) -> None:
    adapter = LoraAdapter.for_model(tiny_llama, LoraConfig(rank=2))
    adapter.save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "adapter_config.json").read_text())
    (tmp_path / "adapter_config.json").write_text(json.dumps(raw | {"lora_dropout": 0.1}))
    with pytest.raises(InvalidArgument, match="lora_dropout"):
        LoraAdapter.from_pretrained(tiny_llama, tmp_path)
    with pytest.raises(InvalidArgument, match="targets"):
        LoraConfig(targets=("lm_head",))
