"""Every model family behind the Architecture seam against transformers' own model, in float32: chained spans
with a KV cache (prefill, then token by token), the client head tied and untied, exported tensor names, LoRA
targets, and the options each family refuses. Gemma 2's hooks and window are in test_gemma2.py."""

from __future__ import annotations

import pytest
import torch

from peers.training.stage_model import load_stage_model
from swarm.errors import UnsupportedArchitectureError
from swarm.partition import BlockConfig, architecture_of, load_client_head, load_span, open_checkpoint
from swarm.partition.architecture import FAMILIES

from .conftest import SaveTiny, logits_step_by_step, tiny_config

LAYERS = 4
PARTS = ((0, 1), (1, 3), (3, 4))
TOLERANCE = 1e-5
CASES = [
    ("llama", {}),
    ("qwen2", {}),
    ("qwen3", {}),
    ("qwen3", {"attention_bias": True, "tie_word_embeddings": True}),
    ("mixtral", {}),
    ("mixtral", {"num_local_experts": 8, "num_experts_per_tok": 3}),
    ("phi3", {}),
    ("phi3", {"partial_rotary_factor": 0.5}),
    ("gemma2", {}),
    ("gemma2", {"attention_bias": True, "tie_word_embeddings": False}),
]
LONGROPE = {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}
IDS = [f"{family}{'-' if options else ''}{'-'.join(options)}" for family, options in CASES]


@pytest.mark.parametrize(("family", "options"), CASES, ids=IDS)
@torch.inference_mode()
def test_spans_with_caches_give_transformers_logits_prompt_then_token_by_token(
    save_tiny: SaveTiny, family: str, options: dict
) -> None:
    path, reference = save_tiny(family, perturb=True, num_hidden_layers=LAYERS, **options)
    input_ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(1))
    expected = reference(input_ids).logits
    logits, _ = logits_step_by_step(path, input_ids, PARTS, prefill=5)
    assert (logits - expected).abs().max() < TOLERANCE


@pytest.mark.parametrize(("family", "options"), CASES, ids=IDS)
@torch.inference_mode()
def test_each_block_matches_its_transformers_layer(save_tiny: SaveTiny, family: str, options: dict) -> None:
    path, reference = save_tiny(family, perturb=True, num_hidden_layers=LAYERS, **options)
    input_ids = torch.randint(0, 128, (1, 7), generator=torch.Generator().manual_seed(2))
    outputs = reference(input_ids, output_hidden_states=True).hidden_states  # embeddings, then each layer's (normed)
    span = load_span(path, 0, LAYERS)
    hidden = outputs[0]
    for index in range(LAYERS - 1):  # the last entry has the final norm applied
        hidden = span(hidden, blocks=range(index, index + 1))
        assert (hidden - outputs[index + 1]).abs().max() < TOLERANCE


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("family", ["qwen3", "mixtral", "phi3"])
@torch.inference_mode()
def test_the_client_head_gives_transformers_embeddings_and_logits(
    save_tiny: SaveTiny, family: str, tied: bool
) -> None:
    path, reference = save_tiny(family, perturb=True, num_hidden_layers=2, tie_word_embeddings=tied)
    head = load_client_head(path)
    input_ids = torch.randint(0, 128, (2, 5), generator=torch.Generator().manual_seed(3))
    assert torch.equal(head.embed(input_ids), reference.model.embed_tokens(input_ids))
    hidden = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(4))
    expected = reference.lm_head(reference.model.norm(hidden))
    assert (head.logits(hidden) - expected).abs().max() < TOLERANCE
    assert (head.lm_head.weight is head.embed_tokens.weight) == tied


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mixtral", "phi3", "gemma2"])
def test_a_whole_model_of_stages_exports_the_checkpoints_own_tensor_names(save_tiny: SaveTiny, family: str) -> None:
    path, _ = save_tiny(family, num_hidden_layers=2, tie_word_embeddings=False)  # stages export untied
    checkpoint = open_checkpoint(path)[0]
    first, last = load_stage_model(path, 0, 1).hf_state_dict(), load_stage_model(path, 1, 2).hf_state_dict()
    assert sorted(first | last) == checkpoint.tensor_names()
    assert all(torch.equal(tensor, checkpoint.read([name])[name]) for name, tensor in (first | last).items())


def test_mixtral_reads_its_experts_under_the_checkpoint_names_and_exports_them_back(save_tiny: SaveTiny) -> None:
    path, reference = save_tiny("mixtral", num_hidden_layers=2)
    checkpoint, _, cfg = open_checkpoint(path)
    names = architecture_of("mixtral").block_tensors(cfg, 1)
    assert "model.layers.1.block_sparse_moe.experts.3.w2.weight" in names
    assert names["model.layers.1.block_sparse_moe.gate.weight"] == "mlp.gate.weight"
    exported = load_stage_model(path, 0, 2).hf_state_dict()
    assert sorted(exported) == checkpoint.tensor_names()
    up = reference.state_dict()["model.layers.1.mlp.experts.gate_up_proj"][2, 96:]  # transformers fuses w1 and w3
    assert torch.equal(exported["model.layers.1.block_sparse_moe.experts.2.w3.weight"], up)


def test_a_mixtral_stage_trains_router_and_experts_to_transformers_loss(save_tiny: SaveTiny) -> None:
    path, reference = save_tiny("mixtral", perturb=True, num_hidden_layers=2)
    stage = load_stage_model(path, 0, 2)
    generator = torch.Generator().manual_seed(6)
    input_ids, labels = (torch.randint(0, 128, (2, 7), generator=generator) for _ in range(2))
    loss = stage(input_ids, labels)
    expected = torch.nn.functional.cross_entropy(reference(input_ids).logits.flatten(0, 1), labels.flatten())
    assert abs(loss.item() - expected.item()) < TOLERANCE
    loss.backward()
    moe = stage.span.blocks[1].mlp
    assert moe.gate.weight.grad.abs().sum() > 0
    assert sum(expert.w2.weight.grad is not None for expert in moe.experts) >= moe.top_k  # routed to


def test_phi3_partial_rotary_rotates_part_of_each_head() -> None:
    cfg = BlockConfig.from_hf(tiny_config("phi3", partial_rotary_factor=0.5))
    assert (cfg.head_dim, cfg.rotary_dim) == (16, 8)


@pytest.mark.parametrize(
    ("family", "options", "named"),
    [
        ("mixtral", {"sliding_window": 16}, "sliding_window=16"),
        ("mistral", {"sliding_window": 16}, "sliding_window=16"),
        ("phi3", {"sliding_window": 32}, "sliding_window=32"),
        ("qwen3", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 0}, "sliding_window=8"),
        ("mixtral", {"router_jitter_noise": 0.1}, "router_jitter_noise=0.1"),
        ("qwen3", {"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ("phi3", {"rope_parameters": LONGROPE, "original_max_position_embeddings": 128}, "rope_type 'longrope'"),
    ],
)
def test_unsupported_options_are_refused_by_name(family: str, options: dict, named: str) -> None:
    with pytest.raises(UnsupportedArchitectureError, match=named):
        BlockConfig.from_hf(tiny_config(family, **options))


def test_an_unknown_model_type_is_refused_by_name() -> None:
    with pytest.raises(UnsupportedArchitectureError, match=r"model_type 'gemma3' is not supported"):
        architecture_of("gemma3")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_familys_lora_targets_are_linear_layers_of_its_blocks_and_of_transformers_model(family: str) -> None:
    """peft finds a target by the module's name in transformers' model, and peers apply it by its path in our block:
    both must be the same linear layer (Phi-3's fused qkv_proj, Mixtral's attention only)."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(family, num_hidden_layers=1)
    architecture = architecture_of(family)
    reference = AutoModelForCausalLM.from_config(config).model.layers[0]
    ours = architecture.block(BlockConfig.from_hf(config))
    for name, path in architecture.lora_targets().items():
        assert path.rpartition(".")[2] == name
        theirs, mine = reference.get_submodule(path), ours.get_submodule(path)
        assert isinstance(theirs, torch.nn.Linear) and isinstance(mine, torch.nn.Linear)
        assert theirs.weight.shape == mine.weight.shape
    expected = {
        "phi3": {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"},
        "mixtral": {"q_proj", "k_proj", "v_proj", "o_proj"},
    }
    if family in expected:
        assert set(architecture.lora_targets()) == expected[family]
