"""ModelSession: a multi-turn conversation whose KV caches the peers keep between generate() calls, made by
DistributedModelForCausalLM.inference_session()."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar, Token
from typing import TYPE_CHECKING, Protocol

import torch

from swarm.client.arguments import check_session_shape
from swarm.client.prefix_reuse import PromptPrefix
from swarm.errors import InvalidRequest
from swarm.prefix_keys import KEY_TOKENS, TailMemory, prefix_keys, tail_of

if TYPE_CHECKING:
    from swarm.client.head_batching import SharedHead
    from swarm.client.session import InferenceSession
    from swarm.partition.client_head import ClientHead


class SessionHost(Protocol):
    """What a ModelSession uses of the DistributedModelForCausalLM that made it: swarm/client/model.py imports this
    module, so naming that class here would close an import circle."""

    context_length: int
    prefix_salt: bytes  # the client's secret for prefix keys (swarm/prefix_keys.py); b"": no prefix caching
    prefix_namespace: str  # the model's name in them
    prefix_tails: TailMemory  # the last partial pages of its sessions, which a later prompt may continue
    head: ClientHead
    shared_head: SharedHead  # the head's logits, batched across the model's concurrent sessions
    _active: ContextVar[ModelSession | None]  # the session a `with` block made current

    @property
    def active_session(self) -> ModelSession | None: ...

    @active_session.setter
    def active_session(self, session: ModelSession | None) -> None: ...

    def open_session(self, batch_size: int, max_length: int, adapter: str = "") -> InferenceSession: ...


class ModelSession:
    """A multi-turn session: the KV caches on the peers and the tokens they hold. Made by inference_session().

    A session is one conversation: one generate() at a time uses it (a second one, from another thread, raises
    InvalidRequest rather than interleaving tokens into the same caches).
    """

    def __init__(self, model: SessionHost, max_length: int, batch_size: int, adapter: str = "") -> None:
        check_session_shape(max_length, batch_size, model.context_length)
        self.model, self.max_length, self.batch_size, self.adapter = model, max_length, batch_size, adapter
        self.session = model.open_session(batch_size, max_length, adapter)
        self.tokens = torch.zeros(batch_size, 0, dtype=torch.long)  # every token the peers have seen
        self.pending = torch.zeros(batch_size, 0, dtype=torch.long)  # generated last turn, not fed yet
        self._busy = threading.Lock()  # held by the generate() that uses the session
        self._entered: list[Token[ModelSession | None]] = []  # one per `with`, to restore the outer active session
        self._closed = False
        self.cached_tokens = 0  # tokens of its prompts the peers held from their prefix caches

    @property
    def position(self) -> int:
        return self.session.position

    def next_logits(self, ids: torch.Tensor) -> torch.Tensor:
        """Append ids [batch, n] to the session; returns the logits [batch, vocab] that follow the last one."""
        return self.model.shared_head.logits(self._append(ids, ids.shape[1] - 1)[:, -1])

    def last_logits(self, ids: torch.Tensor, count: int) -> torch.Tensor:
        """Append ids [batch, n] to the session; returns the logits [batch, count, vocab] after each of its last
        `count` ids (not all n: the LM head over a long prompt costs as much as a few decoding steps)."""
        return self.model.shared_head.logits(self._append(ids, ids.shape[1] - count)[:, -count:])

    def each_logits(self, ids: torch.Tensor, chunk: int, rows: int | None = None) -> Iterator[torch.Tensor]:
        """Append ids [batch, n] to the session in one step; yields the logits [rows, <= chunk, vocab] after each of
        them, `chunk` positions at a time (a prompt's log-probabilities without [n, vocab] floats at once), for the
        first `rows` rows (None: all; 1 where every row holds the same ids, as n choices of one prompt do)."""
        hidden = self._append(ids)[:rows]
        for start in range(0, hidden.shape[1], chunk):
            yield self.model.shared_head.logits(hidden[:, start : start + chunk])

    def forget(self, count: int) -> None:
        """Roll the session back by its last `count` tokens (rejected drafts); the next step truncates the peers."""
        if count:
            self.session.rollback(self.position - count)
            self.tokens = self.tokens[:, : self.position]

    def check_room(self, tokens: int) -> None:
        """Raises InvalidRequest when `tokens` more would not fit in the session's max_length."""
        if self.position + tokens > self.max_length:
            raise InvalidRequest(f"{self.position + tokens} tokens exceed the session's max_length {self.max_length}")

    def fed(self, ids: torch.Tensor) -> None:
        """ids [batch, n] went through every peer of the session (the shared decoding loop stepped them)."""
        self.tokens = torch.cat([self.tokens, ids], dim=1)

    def _append(self, ids: torch.Tensor, reusable: int = 0) -> torch.Tensor:
        """Feed ids [batch, n]; the hidden states after ids[:, held:], where the peers held the first `held` (at most
        `reusable`: those whose outputs the caller does not need) from their prefix caches."""
        self.check_room(ids.shape[1])
        held = self._start_from_cache(ids, reusable) if self.position == 0 else 0
        hidden = self.session.step(self.model.head.embed(ids[:, held:]))
        self.fed(ids)
        return hidden

    def _start_from_cache(self, ids: torch.Tensor, reusable: int) -> int:
        """The first prompt's first tokens that every peer of the route holds from its cache (rows that are all the
        same prompt only: n choices, beams)."""
        if not self.model.prefix_salt or reusable < KEY_TOKENS or not bool((ids == ids[:1]).all()):
            return 0
        salt, tokens = self.model.prefix_salt, ids[0, :reusable].tolist()
        keys = prefix_keys(salt, self._namespace, tokens)
        prefix = PromptPrefix(keys, self.model.prefix_tails.candidates(salt, keys, tokens), len(tokens))
        held = self.session.use_prefix(prefix, lambda n: self.model.head.embed(ids[:, :n]))
        self.cached_tokens += held
        return held

    def _register_prefix(self) -> None:
        """The pages of the whole conversation, its last partial one too, stay with the peers for its next turn."""
        salt, tokens = self.model.prefix_salt, self.tokens[0].tolist()
        keys = prefix_keys(salt, self._namespace, tokens)
        tail = tail_of(salt, keys, tokens)
        self.session.register_prefix(keys, tail)
        if tail is not None:
            self.model.prefix_tails.remember(keys, tail)

    @property
    def _namespace(self) -> str:
        return f"{self.model.prefix_namespace}/{self.adapter}"

    @contextmanager
    def turn(self, adapter: str = "") -> Iterator[ModelSession]:
        """Hold the session for one generate() call (which asked for `adapter`, "" for any).

        Raises:
            InvalidRequest: another thread is generating in this session now, or the session runs another adapter.
        """
        if adapter and adapter != self.adapter:
            raise InvalidRequest(f"adapter {adapter!r} differs from the session's {self.adapter!r}")
        if not self._busy.acquire(blocking=False):
            raise InvalidRequest("this session is generating in another thread: give each thread its own session")
        try:
            yield self
        finally:
            self._busy.release()

    def close(self) -> None:
        if not self._closed:  # the route's load is released once, whatever calls close()
            self._closed = True
            try:
                if self.model.prefix_salt and self.batch_size == 1 and self.tokens.shape[1] >= KEY_TOKENS:
                    self._register_prefix()
            finally:  # whatever happens to the keys, the peers' sessions close
                self.session.close()
        if self.model.active_session is self:
            self.model.active_session = None

    def __enter__(self) -> ModelSession:
        self._entered.append(self.model._active.set(self))
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.close()
        finally:
            self.model._active.reset(self._entered.pop())
