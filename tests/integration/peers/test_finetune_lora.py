"""LoRA and shallow prompt tuning through two live peers (codec NONE) against local peft training of the same adapter
on the same batches; the adapter saved by the swarm loads into transformers + peft and gives the swarm's logits. Deep
prompt tuning through the peers against the same training in plain torch on the local model. These run on the tiny
random checkpoint of SmolLM2's shape (tests/tiny_checkpoint.py): equality with peft and torch holds for any weights.
The task a LoRA adapter learns through the swarm is learnt on SmolLM2 itself."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from swarm import CodecId, DistributedModelForCausalLM
from swarm.client.deep_prompts import DeepPromptTuning
from swarm.client.lora import LoraAdapter
from swarm.client.prompts import PromptTuning
from swarm.registry import Registry
from swarm.security import SwarmCredentials
from tests.tiny_checkpoint import SHAPE

from .finetune_helpers import batches, local_peft, relative

HIDDEN = SHAPE["hidden"]

STEPS = 20
PTUNE_STEPS = 5
DEEP_STEPS = 3
LR = 1e-3


@pytest.fixture(scope="module")
def swarm_model(tiny_checkpoint_path: Path, tiny_bootstrap: Registry) -> Iterator[DistributedModelForCausalLM]:
    with frozen_swarm_model(tiny_checkpoint_path, tiny_bootstrap) as model:
        yield model


@pytest.fixture(scope="module")
def smollm2_swarm_model(smollm2_path: Path, bootstrap: Registry) -> Iterator[DistributedModelForCausalLM]:
    with frozen_swarm_model(smollm2_path, bootstrap) as model:
        yield model


@contextmanager
def frozen_swarm_model(checkpoint: Path, registry: Registry) -> Iterator[DistributedModelForCausalLM]:
    model = DistributedModelForCausalLM.from_pretrained(
        checkpoint, registry.addresses, codec=CodecId.NONE, credentials=SwarmCredentials.open()
    )
    model.requires_grad_(False)  # only the adapter trains
    try:
        yield model
    finally:
        model.close()


@contextmanager
def without_adapter(model: DistributedModelForCausalLM) -> Iterator[DistributedModelForCausalLM]:
    """The shared `model`, left without an adapter however the test ends."""
    try:
        yield model
    finally:
        model.blocks.adapter = None
        model.blocks.prompts = None


@pytest.fixture
def bare(swarm_model: DistributedModelForCausalLM) -> Iterator[DistributedModelForCausalLM]:
    with without_adapter(swarm_model) as model:
        yield model


@pytest.fixture
def bare_smollm2(smollm2_swarm_model: DistributedModelForCausalLM) -> Iterator[DistributedModelForCausalLM]:
    with without_adapter(smollm2_swarm_model) as model:
        yield model


@pytest.mark.timeout(600)  # 20 steps of each of two 135M models on 2 shared cores: 2 to 5 minutes
def test_lora_through_the_swarm_applies_peft_updates_and_round_trips(bare, tiny_checkpoint_path, tmp_path) -> None:
    swarm_model = bare
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    local = local_peft(tiny_checkpoint_path)
    local.save_pretrained(tmp_path / "init")
    adapter = LoraAdapter.from_pretrained(swarm_model, tmp_path / "init")  # the same initial tensors
    swarm_model.blocks.adapter = adapter
    data = batches(AutoTokenizer.from_pretrained(str(tiny_checkpoint_path)), STEPS)
    trainable = [p for p in local.parameters() if p.requires_grad]
    optimizers = torch.optim.AdamW(trainable, lr=LR), torch.optim.AdamW(adapter.parameters(), lr=LR)
    losses, started = [], time.perf_counter()
    for ids in data:
        for model, optimizer in zip((local, swarm_model), optimizers, strict=True):
            optimizer.zero_grad()
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    elapsed = time.perf_counter() - started
    local_state = {k: v for k, v in local.state_dict().items() if "lora_" in k}
    diffs = []
    for name, tensor in adapter.named().items():
        peft_name = f"base_model.model.model.layers.{name}.default.weight"
        diffs.append(relative(tensor.detach(), local_state[peft_name]))
    print(f"\n{STEPS} steps in {elapsed:.1f} s; max relative diff {max(diffs):.2e}; losses {losses[-2:]}")
    assert losses[-1] < losses[1] - 0.1  # it learned
    assert max(diffs) <= 1e-4

    adapter.save_pretrained(tmp_path / "swarm", base_model=str(tiny_checkpoint_path))
    base = AutoModelForCausalLM.from_pretrained(str(tiny_checkpoint_path), dtype=torch.float32)
    loaded = PeftModel.from_pretrained(base, tmp_path / "swarm").eval()
    with torch.no_grad():
        expected = loaded(input_ids=data[0]).logits
        got = swarm_model(input_ids=data[0]).logits
    gap = float((got - expected).abs().max())
    print(f"round trip: logits max abs diff {gap:.2e}")
    assert gap <= 1e-4


def test_shallow_prompt_tuning_equals_peft_and_round_trips(bare, tiny_checkpoint_path, tmp_path) -> None:
    swarm_model = bare
    from peft import PeftModel, PromptTuningConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(str(tiny_checkpoint_path), dtype=torch.float32)
    local = get_peft_model(base, PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4))
    local.save_pretrained(tmp_path / "init")
    prompts = PromptTuning.from_pretrained(tmp_path / "init")
    data = batches(AutoTokenizer.from_pretrained(str(tiny_checkpoint_path)), PTUNE_STEPS)
    trainable = [p for p in local.parameters() if p.requires_grad]
    optimizers = torch.optim.AdamW(trainable, lr=1e-2), torch.optim.AdamW(prompts.parameters(), lr=1e-2)
    for ids in data:
        for step, optimizer in zip((local, None), optimizers, strict=True):
            optimizer.zero_grad()
            if step is None:
                loss = swarm_model(**prompts.inputs(swarm_model, ids, ids)).loss
            else:
                loss = local(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
    trained = local.state_dict()["prompt_encoder.default.embedding.weight"]
    diff = relative(prompts.prompts.detach(), trained)
    print(f"\nprompt tuning: {PTUNE_STEPS} steps, relative diff {diff:.2e}")
    assert diff <= 1e-4

    prompts.save_pretrained(tmp_path / "swarm", base_model=str(tiny_checkpoint_path), num_layers=30)
    base = AutoModelForCausalLM.from_pretrained(str(tiny_checkpoint_path), dtype=torch.float32)
    loaded = PeftModel.from_pretrained(base, tmp_path / "swarm").eval()
    with torch.no_grad():
        expected = loaded(input_ids=data[0]).logits
        got = swarm_model(**prompts.inputs(swarm_model, data[0])).logits
    assert float((got - expected).abs().max()) <= 1e-4


def local_deep_loss(model, shallow: torch.Tensor, deep: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Deep prompt tuning written out in plain torch on the transformers model: shallow prompts prepended, and
    deep[i] added to the first positions of the hidden states entering decoder layer i (a forward pre-hook)."""
    tokens = shallow.shape[0]

    def adder(index: int):
        def hook(module, args, kwargs):
            key = "hidden_states" if "hidden_states" in kwargs else None
            hidden = kwargs[key] if key else args[0]
            hidden = torch.cat([hidden[:, :tokens] + deep[index], hidden[:, tokens:]], dim=1)
            return (args, kwargs | {key: hidden}) if key else ((hidden, *args[1:]), kwargs)

        return hook

    handles = [
        layer.register_forward_pre_hook(adder(i), with_kwargs=True) for i, layer in enumerate(model.model.layers)
    ]
    try:
        embeds = torch.cat([shallow.expand(ids.shape[0], -1, -1), model.get_input_embeddings()(ids)], dim=1)
        labels = torch.cat([torch.full((ids.shape[0], tokens), -100), ids], dim=1)
        return model(inputs_embeds=embeds, labels=labels).loss
    finally:
        for handle in handles:
            handle.remove()


def test_deep_prompt_tuning_equals_plain_torch(bare, tiny_checkpoint_path) -> None:
    swarm_model = bare
    from transformers import AutoModelForCausalLM, AutoTokenizer

    generator = torch.Generator().manual_seed(0)
    tuning = DeepPromptTuning(
        4,
        HIDDEN,
        30,
        torch.randn(4, HIDDEN, generator=generator) * 0.02,
        torch.randn(30, 4, HIDDEN, generator=generator) * 0.02,
    )
    tuning.attach(swarm_model)
    local = AutoModelForCausalLM.from_pretrained(str(tiny_checkpoint_path), dtype=torch.float32).requires_grad_(False)
    shallow = tuning.prompts.detach().clone().requires_grad_(True)
    deep = tuning.deep_prompts.detach().clone().requires_grad_(True)
    data = batches(AutoTokenizer.from_pretrained(str(tiny_checkpoint_path)), DEEP_STEPS)
    optimizers = torch.optim.AdamW([shallow, deep], lr=1e-2), torch.optim.AdamW(tuning.parameters(), lr=1e-2)
    losses, started = [], time.perf_counter()
    for ids in data:
        for optimizer in optimizers:
            optimizer.zero_grad()
            if optimizer is optimizers[1]:
                loss = swarm_model(**tuning.inputs(swarm_model, ids, ids)).loss
            else:
                loss = local_deep_loss(local, shallow, deep, ids)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    diffs = relative(tuning.prompts.detach(), shallow.detach()), relative(tuning.deep_prompts.detach(), deep.detach())
    elapsed = time.perf_counter() - started
    print(f"\ndeep prompt tuning: {DEEP_STEPS} steps in {elapsed:.1f} s, relative diffs {diffs}, losses {losses}")
    assert float(deep.grad[1:].norm()) > 0  # the per-block prompts of every block get a gradient of their own
    assert relative(tuning.deep_prompts.grad, deep.grad) <= 1e-4
    assert max(diffs) <= 1e-4
    assert abs(losses[-1] - losses[-2]) <= 1e-4 * abs(losses[-2])


@pytest.mark.parametrize(("method", "peft_type"), [("lora", "LORA"), ("deep_ptune", "SWARM_DEEP_PROMPT_TUNING")])
def test_swarm_finetune_command_saves_an_adapter(
    tiny_checkpoint_path, tiny_bootstrap: Registry, tmp_path, capsys, method, peft_type
) -> None:
    import json

    import yaml

    from swarm.cli import main

    job = {
        "model": str(tiny_checkpoint_path),
        "initial_peers": list(tiny_bootstrap.addresses),
        "dataset": str(Path(__file__).resolve().parents[2] / "data" / "finetune_tags.jsonl"),
        "method": method,
        "lora": {"rank": 4, "alpha": 8, "targets": ["q_proj", "v_proj"]},
        "ptune": {"num_tokens": 4},
        "steps": 2,
        "batch_size": 2,
        "codec": "none",
        "output_dir": str(tmp_path / "adapter"),
    }
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    assert main(["finetune", str(tmp_path / "job.yaml"), "--open"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["steps"] == 2 and summary["final_loss"] > 0 and 0 <= summary["exact_match"] <= 1
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["peft_type"] == peft_type and config.get("r", 4) == 4 and config.get("num_virtual_tokens", 4) == 4
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()


LEARN_STEPS, LEARN_BATCH, LEARN_LR = 15, 8, 5e-3
DATASET = Path(__file__).resolve().parents[2] / "data" / "finetune_tags.jsonl"


def greedy_exact_match(model, tokenizer, examples) -> float:
    """Share of examples whose greedy generation (transformers' generate, left-padded batch) is exactly the
    completion's tokens followed by EOS."""
    from swarm.finetune.data import encode

    tokenizer.padding_side = "left"
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    batch = tokenizer([e.prompt for e in examples], return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=12, do_sample=False, pad_token_id=pad)
    hits = 0
    for example, row in zip(examples, out[:, batch.input_ids.shape[1] :].tolist(), strict=True):
        _, labels = encode(tokenizer, example, 128)
        want = [token for token in labels if token != -100]  # the completion and EOS
        hits += row[: len(want)] == want
    return hits / len(examples)


@pytest.mark.system  # convergence (tests/tiers.py): it runs beside the integration tier, which is the longer one
@pytest.mark.timeout(300)  # about 60-90 s on the loaded 2-core machine
def test_lora_through_the_swarm_teaches_the_task_greedy_answers(bare_smollm2, smollm2_path, tmp_path) -> None:
    """The issue's must-show: after LoRA fine-tuning through the swarm, greedy answers with the adapter (the peft
    adapter the swarm saved, run by transformers) reach >= 90% exact match where the base model scores < 10%."""
    swarm_model = bare_smollm2
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from swarm.client.lora import LoraConfig
    from swarm.finetune import FineTuner, load_examples
    from swarm.finetune.data import batches as task_batches

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_path))
    examples = load_examples(DATASET)
    base = AutoModelForCausalLM.from_pretrained(str(smollm2_path), dtype=torch.float32).eval()
    before = greedy_exact_match(base, tokenizer, examples)

    torch.manual_seed(0)
    tuner = FineTuner(swarm_model, "lora", LoraConfig(rank=8, alpha=16.0), lr=LEARN_LR)
    stream = task_batches(tokenizer, examples, LEARN_BATCH, 64, seed=0)
    started = time.perf_counter()
    try:
        losses = [tuner.step(next(stream)) for _ in range(LEARN_STEPS)]
        tuner.save(tmp_path / "adapter", base_model=str(smollm2_path))
    finally:
        tuner.close()
    trained_s = time.perf_counter() - started
    tuned = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    after = greedy_exact_match(tuned, tokenizer, examples)
    print(f"\ngreedy exact match {before:.3f} -> {after:.3f}; {LEARN_STEPS} steps in {trained_s:.1f} s; {losses[::5]}")
    assert before < 0.1
    assert after >= 0.9
