"""DistributedModelForCausalLM: a causal LM whose blocks run in the swarm and which reads like Hugging Face's.

The client holds the embeddings, final norm and LM head; everything between goes through inference sessions
routed over the peers the registry lists. No Ray is needed on the client. One model object serves many threads at
once: each generate() runs its own session unless the calling thread is inside `with model.inference_session()`.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar, Token
from pathlib import Path
from typing import Any

import torch

from swarm.client.arguments import check_session_shape, checked_input_ids
from swarm.client.drafters import DraftModels
from swarm.client.generate import GenerationParams, Speculation, decode_loop, speculative_decode_loop
from swarm.client.metrics import ClientMetrics
from swarm.client.sequential import RemoteSequential
from swarm.client.session import InferenceSession
from swarm.client.speculative import DraftLength
from swarm.client.view import SwarmView
from swarm.config import ClientConfig, check_speculative
from swarm.errors import CredentialsError, InvalidArgument, InvalidRequest
from swarm.partition import load_client_head, open_checkpoint
from swarm.registry import Registry
from swarm.registry.addresses import initial_peer_list
from swarm.router import Bans, MinLatencyRouter, WiringRouter
from swarm.types import Span

DEFAULT_CONTEXT_LENGTH = 8192  # for configs that do not say (peers allow this much per session by default)


class ModelSession:
    """A multi-turn session: the KV caches on the peers and the tokens they hold. Made by inference_session().

    A session is one conversation: one generate() at a time uses it (a second one, from another thread, raises
    InvalidRequest rather than interleaving tokens into the same caches).
    """

    def __init__(self, model: DistributedModelForCausalLM, max_length: int, batch_size: int) -> None:
        check_session_shape(max_length, batch_size, model.context_length)
        self.model, self.max_length, self.batch_size = model, max_length, batch_size
        self.session = InferenceSession(
            model.router,
            model.view.peers,
            Span(0, model.num_blocks),
            batch_size,
            max_length,
            model.client_config.codec,
            model.client_config.step_timeout_s,
            model.client_config.max_failovers,
            model.client_config.push,
            model.metrics,
            credentials=model.credentials,
            wait_s=model.client_config.wait_for_blocks_s,
        )
        config = model.client_config
        if config.verify_fraction > 0:
            self.session.enable_verification(config.verify_fraction, config.verify_margin)
        self.tokens = torch.zeros(batch_size, 0, dtype=torch.long)  # every token the peers have seen
        self.pending = torch.zeros(batch_size, 0, dtype=torch.long)  # generated last turn, not fed yet
        self._busy = threading.Lock()  # held by the generate() that uses the session
        self._entered: list[Token[ModelSession | None]] = []  # one per `with`, to restore the outer active session
        self._closed = False

    @property
    def position(self) -> int:
        return self.session.position

    def next_logits(self, ids: torch.Tensor) -> torch.Tensor:
        """Append ids [batch, n] to the session; returns the logits [batch, vocab] that follow the last one."""
        return self.model.head.logits(self._append(ids)[:, -1])

    def last_logits(self, ids: torch.Tensor, count: int) -> torch.Tensor:
        """Append ids [batch, n] to the session; returns the logits [batch, count, vocab] after each of its last
        `count` ids (not all n: the LM head over a long prompt costs as much as a few decoding steps)."""
        return self.model.head.logits(self._append(ids)[:, -count:])

    def forget(self, count: int) -> None:
        """Roll the session back by its last `count` tokens (rejected drafts); the next step truncates the peers."""
        if count:
            self.session.rollback(self.position - count)
            self.tokens = self.tokens[:, : self.position]

    def _append(self, ids: torch.Tensor) -> torch.Tensor:
        if self.position + ids.shape[1] > self.max_length:
            raise InvalidRequest(
                f"{self.position + ids.shape[1]} tokens exceed the session's max_length {self.max_length}"
            )
        hidden = self.session.step(self.model.head.embed(ids))
        self.tokens = torch.cat([self.tokens, ids], dim=1)
        return hidden

    @contextmanager
    def turn(self) -> Iterator[ModelSession]:
        """Hold the session for one generate() call.

        Raises:
            InvalidRequest: another thread is generating in this session now.
        """
        if not self._busy.acquire(blocking=False):
            raise InvalidRequest("this session is generating in another thread: give each thread its own session")
        try:
            yield self
        finally:
            self._busy.release()

    def close(self) -> None:
        if not self._closed:  # the route's load is released once, whatever calls close()
            self._closed = True
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


class DistributedModelForCausalLM:
    def __init__(self, path: str | Path, initial_peers: str | Sequence[str], config: ClientConfig) -> None:
        if config.credentials is None:
            raise CredentialsError(
                "no swarm credentials: pass credentials=SwarmCredentials.load(DIR) (a private swarm's member) "
                "or credentials=SwarmCredentials.open() (an open swarm)"
            )
        _, self.config, block_config = open_checkpoint(path)  # a wrong path fails here, by name
        initial_peers = initial_peer_list(initial_peers)
        self.client_config, self.credentials = config, config.credentials
        self.num_blocks = block_config.num_layers
        self.context_length = int(getattr(self.config, "max_position_embeddings", None) or DEFAULT_CONTEXT_LENGTH)
        self.head = load_client_head(path)
        self.registry = Registry(initial_peers, host=config.dht_host, client_mode=True, credentials=self.credentials)
        name = config.model_name or Path(path).name
        self.metrics = ClientMetrics(name)
        self._draft_models = DraftModels()  # speculative="draft:PATH" models, loaded on first use
        self.metrics_address = (
            "" if config.metrics_port is None else self.metrics.serve(config.dht_host, config.metrics_port)
        )
        self.view = SwarmView(self.registry, name, self.credentials, config.refresh_s)
        self.router = MinLatencyRouter(rtt_s=self.view.rtt_s, bans=Bans(config.ban_base_s, config.ban_max_s))
        self.blocks = RemoteSequential(
            WiringRouter(bans=self.router.bans),
            self.view.peers,
            Span(0, self.num_blocks),
            config.codec,
            timeout_s=config.step_timeout_s * 4,
            max_retries=config.max_failovers,
            metrics=self.metrics,
            credentials=self.credentials,
        )
        # Per thread and per asyncio task, not per object: asyncio.to_thread copies the caller's context into its
        # worker (a threading.local would not follow), and a new thread starts without one. Made per model so
        # that two models' sessions do not shadow each other; `with` resets it, so no context keeps a session alive.
        self._active: ContextVar[ModelSession | None] = ContextVar(f"swarm_active_session_{id(self)}", default=None)

    @property
    def active_session(self) -> ModelSession | None:
        """The session generate() continues when given none: the innermost `with model.inference_session()` of the
        calling thread (or asyncio task), never another thread's."""
        return self._active.get()

    @active_session.setter
    def active_session(self, session: ModelSession | None) -> None:
        self._active.set(session)

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        initial_peers: str | Sequence[str],
        config: ClientConfig | None = None,
        **overrides: Any,
    ) -> DistributedModelForCausalLM:
        """Load the client part of the checkpoint at `path` and join the swarm through `initial_peers` (one
        multiaddress or a list of them).

        Keyword overrides set ClientConfig fields, e.g. `codec=CodecId.NONE`. `credentials` is required:
        `SwarmCredentials.load(DIR)` to join a private swarm as a member, or `SwarmCredentials.open()`.

        Raises:
            CheckpointError: `path` is not a checkpoint directory RaySwarm can read.
            InvalidArgument: no initial peer, an address that does not parse, or an unknown ClientConfig field.
            CredentialsError: no credentials were given.
            PeerUnavailable: the DHT could not be joined through `initial_peers`.
        """
        unknown = sorted(set(overrides) - {field.name for field in dataclasses.fields(ClientConfig)})
        if unknown:
            raise InvalidArgument(unknown[0], "not a ClientConfig field (those are listed in swarm/config.py)")
        return cls(path, initial_peers, dataclasses.replace(config or ClientConfig(), **overrides))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Teacher-forced logits [batch, seq, vocab] for input_ids [batch, seq], through forward calls (no cache);
        differentiable with respect to the client's own parameters, as fine-tuning needs."""
        return self.head.logits(self.blocks(self.head.embed(input_ids)))

    __call__ = forward

    def inference_session(self, max_length: int, batch_size: int = 1) -> ModelSession:
        """`with model.inference_session(max_length=N) as s:` keeps the peers' KV caches between generate() calls;
        inside it, generate() takes only the new tokens of each turn."""
        return ModelSession(self, max_length, batch_size)

    def generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int = 20,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        repetition_penalty: float = 1.0,
        eos_token_id: int | Sequence[int] | None = None,
        pad_token_id: int | None = None,
        streamer: Any | None = None,
        attention_mask: torch.Tensor | None = None,
        session: ModelSession | None = None,
        max_length: int | None = None,
        logits_processor: Sequence[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] | None = None,
        stopping_criteria: Sequence[Callable[..., Any]] | None = None,
        generator: torch.Generator | None = None,
        speculative: str | None = None,
        num_speculative_tokens: int | None = None,
    ) -> torch.Tensor:
        """Like transformers' generate: returns input_ids followed by the new tokens, [batch, n + new].

        `logits_processor` and `stopping_criteria` take Hugging Face's lists (LogitsProcessorList,
        StoppingCriteriaList) or any callables of that signature. `generator` (not in Hugging Face) draws the
        samples: a seeded torch.Generator gives the same text for the same seed, whatever other threads do.

        `speculative` ("prompt_lookup", "draft:PATH"; "" for none; None: ClientConfig.speculative) drafts up to
        `num_speculative_tokens` tokens (None: ClientConfig's) on the client and verifies them in one step through
        the swarm: the same tokens as without it when greedy, the same distribution when sampling, in fewer round
        trips. `speculation_stats()` counts drafted and accepted tokens.

        Thread-safe: concurrent calls on one model each run their own session, except that `session` (or the
        calling thread's `with model.inference_session()`) continues that conversation.

        Raises:
            InvalidRequest: padded batches (attention_mask with zeros), arguments out of range, or a session that
                another thread is generating in.
            InvalidArgument: an unknown `speculative` kind, a draft path that is no checkpoint, or
                `num_speculative_tokens` out of [1, 32].
        """
        input_ids = checked_input_ids(input_ids, self.head.embed_tokens.num_embeddings)
        if attention_mask is not None and not bool(attention_mask.all()):
            raise InvalidRequest("padded batches are not supported yet: pass sequences of equal length")
        params = self._params(
            max_new_tokens, do_sample, temperature, top_k, top_p, repetition_penalty, eos_token_id, pad_token_id
        )
        speculation = self._speculation(speculative, num_speculative_tokens)
        if streamer is not None:
            streamer.put(input_ids)
        length = max_length or input_ids.shape[1] + max_new_tokens
        try:
            with self._session_for(session, input_ids.shape[0], length) as turn:
                extras = (logits_processor or (), stopping_criteria or (), generator)
                new = self._decode(turn, input_ids, params, streamer, speculation, *extras)
        finally:
            if streamer is not None:
                streamer.end()
        return torch.cat([input_ids, new], dim=1)

    @contextmanager
    def _session_for(self, session: ModelSession | None, batch_size: int, max_length: int) -> Iterator[ModelSession]:
        """The session a generate() call runs in: `session`, else the calling thread's active one (held for the
        call), else a new one that no other call sees, closed afterwards."""
        session = session or self.active_session
        if session is not None:
            with session.turn():
                yield session
            return
        own = self.inference_session(max_length, batch_size)
        try:
            yield own
        finally:
            own.close()

    def _speculation(self, speculative: str | None, num_speculative_tokens: int | None) -> tuple[str, int]:
        """The speculative kind and draft length a generate() call asked for (ClientConfig's by default), checked."""
        config = self.client_config
        kind = config.speculative if speculative is None else speculative
        k = config.num_speculative_tokens if num_speculative_tokens is None else num_speculative_tokens
        check_speculative(kind, k)
        if kind:
            self._draft_models.check(kind)
        return kind, k

    def _decode(
        self,
        session: ModelSession,
        input_ids: torch.Tensor,
        params: GenerationParams,
        streamer: Any | None,
        speculation: tuple[str, int],
        logits_processor: Sequence[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]],
        stopping_criteria: Sequence[Callable[..., Any]],
        generator: torch.Generator | None,
    ) -> torch.Tensor:
        """The new tokens [batch, <= max_new_tokens] after input_ids, fed to `session` after last turn's last token."""
        feed = torch.cat([session.pending, input_ids], dim=1)
        extras = (streamer, logits_processor, stopping_criteria, generator)
        kind, k = speculation
        if not kind:
            new = decode_loop(session.next_logits, session.tokens, feed, params, *extras)
        else:
            drafts = Speculation(
                self._draft_models.drafter_for(kind, self.head.lm_head.out_features),
                DraftLength(k),
                session.forget,
                self._count_drafts,
                lambda: session.max_length - session.position,
            )
            new = speculative_decode_loop(session.last_logits, session.tokens, feed, params, drafts, *extras)
        session.pending = new[:, -1:]
        return new

    def _count_drafts(self, drafted: int, accepted: int) -> None:
        self.metrics.drafted_tokens.inc(drafted)
        self.metrics.accepted_tokens.inc(accepted)

    def speculation_stats(self) -> dict[str, float]:
        """Speculative decoding so far on this model: drafted and accepted tokens and their ratio."""
        return self.metrics.speculation()

    def _params(self, max_new_tokens, do_sample, temperature, top_k, top_p, repetition_penalty, eos, pad):
        eos = self.config.eos_token_id if eos is None else eos
        eos_ids = () if eos is None else (tuple(eos) if isinstance(eos, Sequence) else (int(eos),))
        pad = pad if pad is not None else (self.config.pad_token_id if self.config.pad_token_id is not None else 0)
        return GenerationParams(max_new_tokens, do_sample, temperature, top_k, top_p, repetition_penalty, eos_ids, pad)

    def close(self) -> None:
        self.blocks.close()
        self.view.close()
        self.registry.shutdown()
        self.metrics.close()
