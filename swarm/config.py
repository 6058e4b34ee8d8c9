"""Typed client configuration, in one place. Field names carry their units."""

from __future__ import annotations

from dataclasses import dataclass

from swarm.codec import DEFAULT_CODEC, DEFAULT_COMPRESS_MIN_BYTES, CodecId
from swarm.errors import InvalidArgument
from swarm.security import SwarmCredentials

PROMPT_LOOKUP = "prompt_lookup"  # ClientConfig.speculative's values (swarm/client/drafters.py)
DRAFT_PREFIX = "draft:"
MAX_SPECULATIVE_TOKENS = 32
MAX_SALT_BYTES = 64  # BLAKE2b's longest key (swarm/prefix_keys.py)


@dataclass(frozen=True, slots=True)
class ClientConfig:
    model_name: str = ""  # registry key; "" means the checkpoint directory's name
    codec: CodecId = DEFAULT_CODEC  # how hidden states travel, both ways
    # Tensors smaller than this travel uncompressed whatever `codec` says (swarm/codec: the reason); 0: never.
    compress_min_bytes: int = DEFAULT_COMPRESS_MIN_BYTES
    step_timeout_s: float = 30.0  # a peer that does not answer a step within this is failed over
    # A session whose blocks no live peer serves, or whose peers are all full, waits this long for one (peers
    # restart, join, free pages) before raising MissingBlocks or Overloaded.
    wait_for_blocks_s: float = 30.0
    max_failovers: int = 8  # per session, before giving up
    refresh_s: float = 5.0  # how often the view of the registry is refreshed in the background
    ban_base_s: float = 1.0  # first ban of a failed peer; doubles with each failure in a row
    ban_max_s: float = 60.0
    dht_host: str = "127.0.0.1"  # address of the client's own (client-mode) DHT node
    push: bool = True  # peers forward each step's output to the next peer themselves (server-to-server push)
    metrics_port: int | None = None  # serve the client's Prometheus /metrics on dht_host:port (0: any); None: not
    # SwarmCredentials.load(DIR) for a private swarm, SwarmCredentials.open() for an open one; None: refused
    credentials: SwarmCredentials | None = None
    # Fraction of inference steps also run on a second replica of each hop's span; a peer whose answer disagrees
    # beyond the codec's tolerance is banned (swarm/client/verify.py). 0: off; 1: every step, about twice the work.
    verify_fraction: float = 0.0
    verify_margin: float = 0.01  # relative L2 allowed on top of 2 x the codec's max_error (swarm/client/checks.py)
    # Speculative decoding (swarm/client/drafters.py): "" off; "prompt_lookup" drafts by n-gram lookup in the text
    # so far; "draft:PATH" drafts with a small local causal LM sharing the tokenizer. Verified in one step per round.
    speculative: str = ""
    num_speculative_tokens: int = 5  # the most tokens drafted per step (fewer while drafts are being rejected)
    # Prefix caching (swarm/prefix_keys.py): a prompt starts from the KV pages that peers kept of this client's
    # earlier sessions that began the same way. The salt is the client's secret: b"" draws one per model object;
    # API replicas given the same salt share their cached prompts.
    prefix_cache: bool = True
    prefix_salt: bytes = b""

    def __post_init__(self) -> None:
        for name in ("step_timeout_s", "refresh_s", "ban_base_s", "ban_max_s"):
            if not getattr(self, name) > 0:
                raise InvalidArgument(name, f"must be > 0, got {getattr(self, name)}")
        if self.wait_for_blocks_s < 0:
            raise InvalidArgument("wait_for_blocks_s", f"must be >= 0, got {self.wait_for_blocks_s}")
        for name in ("max_failovers", "compress_min_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidArgument(name, f"must be an int >= 0, got {value!r}")
        if not isinstance(self.codec, CodecId):
            names = ", ".join(codec.name for codec in CodecId)
            raise InvalidArgument("codec", f"expected a CodecId ({names}), got {self.codec!r}")
        if not 0.0 <= self.verify_fraction <= 1.0:
            raise InvalidArgument("verify_fraction", f"must be in [0, 1], got {self.verify_fraction}")
        if self.verify_margin < 0:
            raise InvalidArgument("verify_margin", f"must be >= 0, got {self.verify_margin}")
        check_speculative(self.speculative, self.num_speculative_tokens)
        if isinstance(self.prefix_salt, str):  # from a config file (swarm api's client_options)
            object.__setattr__(self, "prefix_salt", self.prefix_salt.encode())
        if not isinstance(self.prefix_salt, bytes) or len(self.prefix_salt) > MAX_SALT_BYTES:
            raise InvalidArgument("prefix_salt", f"must be bytes (or text) of at most {MAX_SALT_BYTES} bytes")


def check_speculative(speculative: object, num_speculative_tokens: object) -> None:
    """Raises InvalidArgument unless `speculative` is "" (off), "prompt_lookup" or "draft:PATH" and
    `num_speculative_tokens` an int in [1, MAX_SPECULATIVE_TOKENS]. The path is checked when a drafter is built."""
    draft = isinstance(speculative, str) and speculative.startswith(DRAFT_PREFIX) and len(speculative) > 6
    if not (draft or speculative in ("", PROMPT_LOOKUP)):
        raise InvalidArgument(
            "speculative", f'expected "", "{PROMPT_LOOKUP}" or "{DRAFT_PREFIX}PATH", got {speculative!r}'
        )
    if isinstance(num_speculative_tokens, bool) or not isinstance(num_speculative_tokens, int):
        raise InvalidArgument("num_speculative_tokens", f"must be an int, got {num_speculative_tokens!r}")
    if not 1 <= num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
        raise InvalidArgument(
            "num_speculative_tokens", f"must be in [1, {MAX_SPECULATIVE_TOKENS}], got {num_speculative_tokens}"
        )
