"""Serving named LoRA adapters per session on the two shared SmolLM2 peers (codec NONE): 8 concurrent sessions over
3 peft adapters and the bare model, batched together on the same peers, each equal token for token to local
transformers + peft; a route avoids a peer without the adapter; an unknown adapter is refused clearly; an open
swarm's client cannot publish one."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch

from peers.served_adapters import ServedAdapters
from peers.server import PeerServer
from swarm import CodecId, DistributedModelForCausalLM
from swarm.client.lora import PEFT_PREFIX, LoraConfig, peft_config
from swarm.errors import MissingBlocks
from swarm.registry import Registry
from swarm.security import SwarmCredentials

from .wire import session_requests

ADAPTERS = ("alpha", "beta", "gamma")
PROMPTS = [
    "The lighthouse keeper wrote",
    "Bread rises slowly in",
    "A train left the station",
    "The river froze so hard",
    "Old maps mark the mountain",
    "Every library smells of",
    "The clock in the square",
    "Gardeners say the best time",
]
NEW_TOKENS = 8


def write_adapter(directory: Path, seed: int, layers: int = 30, hidden: int = 576, kv: int = 192) -> None:
    """A random peft LoRA (r=8, q_proj and v_proj) with non-zero B, so that it changes the model's tokens."""
    generator = torch.Generator().manual_seed(seed)
    config = LoraConfig(rank=8, alpha=16.0, targets=("q_proj", "v_proj"))
    tensors = {}
    for block in range(layers):
        for path, out in (("self_attn.q_proj", hidden), ("self_attn.v_proj", kv)):
            prefix = f"{PEFT_PREFIX}{block}.{path}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(8, hidden, generator=generator) * 0.05
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out, 8, generator=generator) * 0.1
    from safetensors.torch import save_file

    directory.mkdir(parents=True)
    (directory / "adapter_config.json").write_text(json.dumps(peft_config(config, "smollm2")))
    save_file(tensors, str(directory / "adapter_model.safetensors"), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def adapter_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("adapters")
    for seed, name in enumerate(ADAPTERS):
        write_adapter(root / name, seed)
    return root


@pytest.fixture(scope="module")
def serving(peer_servers: list[PeerServer], adapter_root: Path) -> Iterator[list[PeerServer]]:
    """The shared peers serve the adapters for this module (as `--adapters DIR` loads them), then stop again."""
    for server in peer_servers:
        server.service.served.load_directory(adapter_root, server.backend.span)
        server.engine.most_adapters = 0
    yield peer_servers
    for server in peer_servers:
        server.service.served = ServedAdapters(server.service.adapters.budget)


@pytest.fixture(scope="module")
def model(smollm2_path: Path, serving: list[PeerServer], bootstrap: Registry) -> Iterator[DistributedModelForCausalLM]:
    # `serving` before `bootstrap`: the records announced name the adapters from the first announce on
    model = DistributedModelForCausalLM.from_pretrained(
        smollm2_path, bootstrap.addresses, codec=CodecId.NONE, credentials=SwarmCredentials.open(), wait_for_blocks_s=1
    )
    yield model
    model.close()


@pytest.fixture(scope="module")
def local(smollm2_path: Path, adapter_root: Path):
    """transformers + peft holding the three adapters, and the tokenizer."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = AutoModelForCausalLM.from_pretrained(str(smollm2_path), dtype=torch.float32).eval()
    model = PeftModel.from_pretrained(base, str(adapter_root / ADAPTERS[0]), adapter_name=ADAPTERS[0])
    for name in ADAPTERS[1:]:
        model.load_adapter(str(adapter_root / name), adapter_name=name)
    return model, AutoTokenizer.from_pretrained(str(smollm2_path))


@torch.inference_mode()
def local_greedy(local, adapter: str, tokens: torch.Tensor) -> torch.Tensor:
    """The token local greedy decoding picks after each prefix of `tokens` [1, n] (peft with `adapter`, or bare)."""
    model, _ = local
    if adapter:
        model.set_adapter(adapter)
        return model(input_ids=tokens).logits.argmax(-1)
    with model.disable_adapter():
        return model(input_ids=tokens).logits.argmax(-1)


def test_eight_sessions_over_three_adapters_and_the_base_batch_together(model, local, serving) -> None:
    """Each session's tokens are the ones local greedy decoding picks with its adapter: checked teacher-forced (one
    local forward over the swarm's whole sequence: every new token is the local argmax after the tokens before it),
    which is what token-for-token equality with a local generate() means, at an eighth of the local compute."""
    _, tokenizer = local
    sessions = [
        (([*ADAPTERS, ""] * 2)[i], tokenizer(prompt, return_tensors="pt").input_ids)
        for i, prompt in enumerate(PROMPTS)
    ]
    results: dict[int, torch.Tensor] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(sessions))

    def run(index: int, adapter: str, ids: torch.Tensor) -> None:
        try:
            barrier.wait()
            results[index] = model.generate(ids, max_new_tokens=NEW_TOKENS, adapter=adapter)
        except BaseException as error:  # reported below
            errors.append(error)

    threads = [threading.Thread(target=run, args=(i, *session)) for i, session in enumerate(sessions)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors, errors
    for index, (adapter, ids) in enumerate(sessions):
        got, prompt_length = results[index], ids.shape[1]
        assert got.shape == (1, prompt_length + NEW_TOKENS)
        picked = local_greedy(local, adapter, got)[:, prompt_length - 1 : -1]
        assert torch.equal(got[:, prompt_length:], picked), (adapter, PROMPTS[index], got, picked)
        if adapter:  # the adapter does change what greedy decoding picks: the test is not vacuous
            assert not torch.equal(picked, local_greedy(local, "", got)[:, prompt_length - 1 : -1]), adapter
    model_local, _ = local  # and, literally, one local peft generate() gives the same tokens as its session
    model_local.set_adapter(ADAPTERS[0])
    with torch.inference_mode():
        generated = model_local.generate(input_ids=sessions[0][1], max_new_tokens=NEW_TOKENS, do_sample=False)
    assert torch.equal(results[0], generated)
    # Rows with different adapters (the bare model counting as one) ran in the same engine iteration.
    most = max(server.engine.most_adapters for server in serving)
    print(f"most distinct adapters in one iteration: {most}")
    assert most >= 2


def test_the_adapters_are_announced_and_routes_need_them(model, serving) -> None:
    peers = model.view.peers(fresh=True)
    assert {tuple(peer.adapters) for peer in peers} == {ADAPTERS}
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(MissingBlocks, match="adapter 'nope'"):
        model.generate(ids, max_new_tokens=2, adapter="nope")


def test_an_unknown_adapter_is_refused_and_the_peer_keeps_serving(stubs, serving) -> None:
    hidden = torch.randn(1, 3, 576)
    requests = list(session_requests("unknown-adapter", [(0, hidden)]))
    requests[0].open.adapter = "nope"
    with pytest.raises(grpc.RpcError) as caught:
        list(stubs[0].Inference(iter(requests)))
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    assert "'nope' is not served here" in caught.value.details() and "alpha" in caught.value.details()
    requests = list(session_requests("known-adapter", [(0, hidden)]))
    requests[0].open.adapter = "beta"
    responses = list(stubs[0].Inference(iter(requests)))
    assert responses and responses[0].position == 3
    bare = list(stubs[0].Inference(session_requests("bare-after", [(0, hidden)])))
    assert bare[0].hidden_states != responses[0].hidden_states  # the adapter changed the output


def test_the_api_serves_base_colon_adapter(smollm2_path: Path, model, local) -> None:
    """The OpenAI API (without Ray Serve): "model": "smollm2:beta" generates what the library does with adapter="beta";
    /v1/models lists the adapters peers announce; an adapter no peer serves is the API's model_not_found."""
    import asyncio

    from transformers import AutoTokenizer

    from swarm.api.errors import ApiError
    from swarm.api.protocol import CompletionRequest
    from swarm.api.service import OpenAIService, ServedModel

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_path))
    service = OpenAIService([ServedModel("smollm2", smollm2_path, model, tokenizer)])
    prompt = PROMPTS[1]
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    expected = model.generate(ids, max_new_tokens=NEW_TOKENS, adapter="beta")  # checked against peft above

    async def complete(name: str) -> dict:
        request = CompletionRequest(model=name, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
        return await service.complete(request)

    try:
        answer = asyncio.run(complete("smollm2:beta"))
        assert answer["model"] == "smollm2:beta"
        assert answer["choices"][0]["text"] == tokenizer.decode(expected[0, ids.shape[1] :], skip_special_tokens=True)
        listed = [card["id"] for card in service.list_models()["data"]]
        assert listed == ["smollm2", *(f"smollm2:{name}" for name in ADAPTERS)]
        with pytest.raises(ApiError, match="smollm2:nope"):
            asyncio.run(complete("smollm2:nope"))
    finally:
        service.executor.shutdown(wait=False)


def test_an_open_swarms_client_cannot_publish_a_served_adapter(model, adapter_root: Path, serving) -> None:
    """serve_adapter in an open swarm is refused by every peer (PERMISSION_DENIED: only a private swarm's members
    may publish; tests/integration/peers/test_adapter_ownership.py has the private case), the operator's names
    included, and sessions go on with the operator's adapters."""
    from swarm.client.adapter_upload import serve_adapter
    from swarm.client.lora import LoraAdapter
    from swarm.errors import PermissionDenied

    upload = LoraAdapter.from_pretrained(model, adapter_root / "alpha")
    for name in ("uploaded", "beta"):
        with pytest.raises(PermissionDenied, match="open swarm"):
            serve_adapter(model, upload, name)
    assert all(server.service.served.names() == ADAPTERS for server in serving)
    ids = torch.tensor([[1, 504, 3, 77]])
    assert model.generate(ids, max_new_tokens=2, adapter="beta").shape == (1, 6)
