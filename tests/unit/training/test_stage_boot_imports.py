"""A training stage replica boots and trains without transformers and without torch's compiler: the job hands it
the model's config as a PortableConfig, and its optimizer is swarm/training/adamw.py. So a replica that Ray restarts
on a busy host imports and builds its stage without transformers' modules (about 0.7 s of a fresh process, and the
family's config module 1.1 s more) and without `torch._dynamo` (1.0 s, which torch.optim's optimizers import the
first time one of their methods runs) before it serves again."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

from swarm.partition import open_checkpoint, portable_config
from swarm.training.init_model import write_random_llama

REPO_ROOT = Path(__file__).resolve().parents[3]

SCRIPT = textwrap.dedent(
    """
    import importlib.abc, math, pickle, sys

    class Refuse(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] == "transformers" or name.split(".")[:2] == ["torch", "_dynamo"]:
                raise ModuleNotFoundError(f"No module named {name!r} (refused by the test)", name=name)

    sys.meta_path.insert(0, Refuse())
    import torch
    from peers.training.actor import stage_registry, stage_replica
    from swarm.training.config import config_from_dict
    from swarm.types import Span

    model, model_config, text = sys.argv[1], pickle.loads(open(sys.argv[2], "rb").read()), sys.argv[3]
    config = config_from_dict({
        "run_id": "boot", "model": model, "num_stages": 1, "replicas_per_stage": 1, "micro_batch": 2,
        "target_batch": 4, "steps": 2, "credentials": "open",
        "data": {"path": text, "tokenizer": "bytes", "seq_len": 8},
    })
    registry = stage_registry(config, [])
    replica = None
    try:
        replica = stage_replica(config, Span(0, 2), registry, model_config)  # the model and its hivemind optimizer
        before = {name: tensor.clone() for name, tensor in replica.model.hf_state_dict().items()}
        ids = torch.randint(0, 256, (2, 9))
        for _ in range(2):  # two micro-batches of 2: the target batch, so the stage steps (alone)
            _, loss, _ = replica.backward(ids[:, :-1], None, ids[:, 1:])
        assert replica.step == 1 and math.isfinite(loss), (replica.step, loss)
        replica.restore(replica.snapshot())  # the optimizer's state_dict and load_state_dict
        after = replica.model.hf_state_dict()
        moved = sum(not torch.equal(before[name], tensor) for name, tensor in after.items())
        assert moved == len(after), f"{moved} of {len(after)} tensors moved"
        print("trained", float(loss))
    finally:
        if replica is not None:
            replica.optimizer.shutdown()
        registry.shutdown()
    """
)


def test_a_stage_replica_boots_and_steps_without_transformers_or_torch_dynamo(tmp_path) -> None:
    model = write_random_llama(tmp_path / "model", layers=2, hidden=64, vocab=256)
    config = tmp_path / "config.pickle"
    config.write_bytes(pickle.dumps(portable_config(open_checkpoint(model)[1])))
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(model), str(config), str(REPO_ROOT / "tests" / "data" / "eval_text.txt")],
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("trained"), result.stdout
