"""`swarm generate --initial-peers ADDR "prompt"`: generate text through the swarm, streaming tokens as they come.

Run: `swarm generate --initial-peers /ip4/127.0.0.1/tcp/PORT/p2p/ID --credentials DIR "Hello"` (or `--open`).
The client loads only the embeddings, final norm and LM head from --model; the blocks run on the peers.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from swarm.cli._credentials import add_credential_flags

DEFAULT_MODEL = Path(".cache/models/smollm2-135m")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("generate", help="generate text through a swarm")
    parser.add_argument("prompt")
    parser.add_argument("--initial-peers", nargs="+", required=True, help="DHT multiaddresses to join through")
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="checkpoint directory (client part)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--repetition-penalty", type=float, default=1.0)
    parser.add_argument("--codec", default="INT8_HADAMARD", help="codec of the hidden states (e.g. NONE)")
    add_credential_flags(parser)
    parser.set_defaults(run=run)


def run(ns: argparse.Namespace) -> int:
    from transformers import AutoTokenizer, TextStreamer

    from swarm.client import DistributedModelForCausalLM
    from swarm.codec import CodecId
    from swarm.security import SwarmCredentials

    credentials = SwarmCredentials.choose(ns.credentials, ns.open)
    tokenizer = AutoTokenizer.from_pretrained(str(ns.model))
    model = DistributedModelForCausalLM.from_pretrained(
        ns.model, ns.initial_peers, codec=CodecId[ns.codec], credentials=credentials
    )
    try:
        input_ids = tokenizer(ns.prompt, return_tensors="pt").input_ids
        print(ns.prompt, end="", flush=True)
        model.generate(
            input_ids,
            max_new_tokens=ns.max_new_tokens,
            do_sample=ns.temperature > 0,
            temperature=ns.temperature or 1.0,
            top_k=ns.top_k,
            top_p=ns.top_p,
            repetition_penalty=ns.repetition_penalty,
            streamer=TextStreamer(tokenizer, skip_prompt=True),
        )
    finally:
        model.close()
    return 0
