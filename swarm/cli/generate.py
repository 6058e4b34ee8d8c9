"""`swarm generate --initial-peers ADDR "prompt"`: generate text through the swarm, streaming tokens as they come.

Run: `swarm generate --initial-peers /ip4/127.0.0.1/tcp/PORT/p2p/ID --credentials DIR "Hello"` (or `--open`);
`--speculative prompt_lookup` (or `draft:PATH`) drafts tokens on the client and verifies several per round trip.
The client loads only the embeddings, final norm and LM head from --model; the blocks run on the peers. A checkpoint
with a chat template (an instruct model) gets the prompt as a user message and prints only its reply; `--raw` sends
the prompt as is and prints it followed by its continuation.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from swarm.cli._arguments import (
    add_initial_peers_flag,
    at_least,
    check_checkpoint_dir,
    in_range,
    non_empty,
    positive,
    speculative,
)
from swarm.cli._credentials import add_credential_flags
from swarm.codec import DEFAULT_CODEC, CodecId
from swarm.config import MAX_SPECULATIVE_TOKENS

DEFAULT_MODEL = Path(".cache/models/smollm2-135m")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("generate", help="generate text through a swarm")
    parser.add_argument("prompt", type=non_empty)
    add_initial_peers_flag(parser)
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="checkpoint directory (client part)")
    parser.add_argument("--max-new-tokens", type=at_least(0), default=64)
    parser.add_argument("--temperature", type=at_least(0, float), default=0.0, help="0: greedy")
    parser.add_argument("--top-k", type=at_least(0), default=0, help="0: off")
    parser.add_argument("--top-p", type=in_range(0, 1, float), default=1.0)
    parser.add_argument("--repetition-penalty", type=positive(), default=1.0, help="1: off")
    parser.add_argument(
        "--speculative",
        type=speculative,
        default="off",
        metavar="KIND",
        help='draft tokens on the client, verify them in one step: "prompt_lookup", "draft:PATH" or "off" (default)',
    )
    parser.add_argument(
        "--num-speculative-tokens", type=in_range(1, MAX_SPECULATIVE_TOKENS), default=5, help="most drafts per step"
    )
    parser.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    parser.add_argument(
        "--codec",
        choices=[codec.name for codec in CodecId],
        default=DEFAULT_CODEC.name,
        help="codec of the hidden states",
    )
    parser.add_argument(
        "--wait-for-blocks",
        type=at_least(0, float),
        default=30.0,
        metavar="S",
        help="how long to wait for peers of blocks no live peer serves before giving up",
    )
    add_credential_flags(parser)
    parser.set_defaults(run=run)


def run(ns: argparse.Namespace) -> int:
    from transformers import AutoTokenizer, TextStreamer

    from swarm.client import DistributedModelForCausalLM
    from swarm.client.chat import has_chat_template, prompt_ids
    from swarm.security import SwarmCredentials

    credentials = SwarmCredentials.choose(ns.credentials, ns.open)
    check_checkpoint_dir(ns.model)
    if ns.speculative.startswith("draft:"):
        check_checkpoint_dir(Path(ns.speculative[len("draft:") :]), "--speculative")
    tokenizer = AutoTokenizer.from_pretrained(str(ns.model))
    model = DistributedModelForCausalLM.from_pretrained(
        ns.model,
        ns.initial_peers,
        codec=CodecId[ns.codec],
        credentials=credentials,
        speculative=ns.speculative,
        num_speculative_tokens=ns.num_speculative_tokens,
        wait_for_blocks_s=ns.wait_for_blocks,
    )
    try:
        input_ids = prompt_ids(tokenizer, ns.prompt, raw=ns.raw)
        chat = not ns.raw and has_chat_template(tokenizer)
        if not chat:  # a continuation reads on from the prompt; a reply stands alone
            print(ns.prompt, end="", flush=True)
        sampling = {"do_sample": True, "temperature": ns.temperature, "top_k": ns.top_k, "top_p": ns.top_p}
        model.generate(
            input_ids,
            max_new_tokens=ns.max_new_tokens,
            repetition_penalty=ns.repetition_penalty,
            streamer=TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=chat),
            **(sampling if ns.temperature > 0 else {"do_sample": False}),  # greedy takes no sampling flags
        )
    finally:
        model.close()
    return 0
