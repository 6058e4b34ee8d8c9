"""swarm/client/lora.py: an adapter saved in peft's format loads into peft (and back) with the same tensors, for
every family on its own targets, its version moves with every optimizer step, and adapters peers cannot compute are
refused by name."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from swarm.client.lora import LoraAdapter, LoraConfig
from swarm.errors import InvalidArgument
from swarm.partition import architecture_of
from swarm.partition.architecture import FAMILIES

from ..partition.conftest import tiny_config


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


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_round_trips_peft_lora_on_all_its_own_targets(family: str, tmp_path) -> None:
    """The client shapes and names an adapter by the family's Architecture.lora_targets(): peft's adapter on all of
    them (Phi-3's fused qkv_proj and gate_up_proj, Mixtral's attention, Gemma 2's Llama-like layers) loads with the
    same tensors, and a target the family lacks is refused naming the family's own."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(family, num_hidden_layers=2))
    targets = sorted(architecture_of(family).lora_targets())
    peft_model = get_peft_model(model, PeftLoraConfig(r=2, lora_alpha=4, target_modules=targets))
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if "lora_" in name:
                parameter.normal_()
    peft_model.save_pretrained(tmp_path)
    adapter = LoraAdapter.from_pretrained(model, tmp_path)
    state = peft_model.state_dict()
    assert len(adapter.names) == 2 * 2 * len(targets)
    for name, tensor in adapter.named().items():
        assert torch.equal(state[f"base_model.model.model.layers.{name}.default.weight"], tensor)
    missing = {"mixtral": "gate_proj", "phi3": "q_proj"}.get(family, "qkv_proj")  # another family's target
    with pytest.raises(InvalidArgument, match=rf"{family} blocks take LoRA on \['"):
        LoraAdapter.for_model(model, LoraConfig(rank=2, targets=(missing,)))
