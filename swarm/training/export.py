"""Reassemble a Hugging Face checkpoint from the newest checkpoint of every stage of a run.

The result loads with `transformers` (AutoModelForCausalLM.from_pretrained). Embeddings and LM head are written
untied: the first and last stage trained their own copies.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

from safetensors.torch import save_file

from swarm.errors import CheckpointError
from swarm.partition import hf_config_of, open_checkpoint
from swarm.partition.client_head import EMBEDDINGS, FINAL_NORM, LM_HEAD
from swarm.training.checkpoints import latest_stage_checkpoint, read_stage_checkpoint

logger = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


def export_run(root: str | Path, run_id: str, base_model: str | Path, out: str | Path) -> dict[str, int]:
    """Write `out` (config.json, model.safetensors, tokenizer files of `base_model`); returns each stage's step.

    Raises:
        CheckpointError: a stage has no checkpoint, or the stages do not cover every block.
    """
    cfg = open_checkpoint(base_model)[2]
    stages = _stage_spans(Path(root) / run_id)
    covered = sorted(b for start, end in stages for b in range(start, end))
    if covered != list(range(cfg.num_layers)):
        raise CheckpointError(f"stage checkpoints of run {run_id} cover blocks {stages}, not [0, {cfg.num_layers})")
    tensors, steps = {}, {}
    for start, end in stages:
        path = latest_stage_checkpoint(root, run_id, start, end)
        if path is None:
            raise CheckpointError(f"stage [{start}, {end}) of run {run_id} has no complete checkpoint under {root}")
        snapshot = read_stage_checkpoint(path)
        tensors.update(snapshot.tensors)
        steps[f"{start}-{end}"] = snapshot.step
    missing = {EMBEDDINGS, FINAL_NORM, LM_HEAD} - set(tensors)
    if missing:
        raise CheckpointError(f"stage checkpoints lack {sorted(missing)}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    config = hf_config_of(base_model).to_dict()  # as transformers writes it
    config["tie_word_embeddings"] = False
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for name in TOKENIZER_FILES:
        if (Path(base_model) / name).is_file():
            shutil.copy(Path(base_model) / name, out / name)
    logger.info("exported run %s (steps %s) to %s", run_id, steps, out)
    return steps


def _stage_spans(run_dir: Path) -> list[tuple[int, int]]:
    spans = []
    for stage in sorted(run_dir.glob("stage-*-*")):
        _, start, end = stage.name.split("-")
        spans.append((int(start), int(end)))
    return spans
