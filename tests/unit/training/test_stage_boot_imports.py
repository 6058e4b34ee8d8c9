"""A training stage replica boots without transformers: the job hands it the model's config as a PortableConfig,
so a replica that Ray restarts on a busy host imports and builds its stage without transformers' modules (about
0.7 s of a fresh process, and the family's config module 1.1 s more) before it serves again."""

from __future__ import annotations

import pickle
import textwrap

from swarm.partition import open_checkpoint
from swarm.training.init_model import write_random_llama

from ...fresh_python import refusing, run_python

SCRIPT = refusing("transformers") + textwrap.dedent(
    """
    import pickle

    import torch
    import peers.training.actor
    from peers.training.stage_model import load_stage_model

    config = pickle.loads(open(sys.argv[2], "rb").read())
    first = load_stage_model(sys.argv[1], 0, 1, hf_config=config)
    last = load_stage_model(sys.argv[1], 1, 2, hf_config=config)
    ids = torch.randint(0, 256, (2, 9))
    loss = last(first(ids), ids)
    assert torch.isfinite(loss), loss
    print("booted", float(loss))
    """
)


def test_a_stage_replica_imports_and_builds_its_stage_without_transformers(tmp_path) -> None:
    model = write_random_llama(tmp_path / "model", layers=2, hidden=64, vocab=256)
    config = tmp_path / "config.pickle"
    config.write_bytes(pickle.dumps(open_checkpoint(model)[1]))
    out = run_python(SCRIPT, str(model), str(config))
    assert out.startswith("booted"), out


def test_the_stage_actor_module_leaves_every_heavy_import_to_the_idle_boot() -> None:
    """Ray imports StageActor's module and unpickles its arguments before __init__ (and its IdleBoot) runs: the
    module imports none of torch, hivemind, grpc or `swarm` (whose package imports torch), and the arguments are
    bytes."""
    out = run_python(
        """
        import sys
        import peers.training.stage_actor
        heavy = sorted(m for m in ("torch", "hivemind", "grpc", "swarm", "transformers", "numpy") if m in sys.modules)
        print("imported", heavy)
        """
    )
    assert out.strip() == "imported []", out
