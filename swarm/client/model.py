"""DistributedModelForCausalLM: a causal LM whose blocks run in the swarm, and a transformers model.

The client holds the embeddings, final norm and LM head; everything between goes through inference sessions
routed over the peers the registry lists. No Ray is needed on the client. The class is a PreTrainedModel with
transformers' GenerationMixin: generate() is Hugging Face's own, over a cache that lives on the peers
(swarm/client/remote_cache.py), so every decoding strategy, logits processor, stopping criterion and pipeline
works. RaySwarm's own extensions (`session`, `generator`, `speculative`) run swarm/client/generate.py's loop instead.
One model serves many threads, each generate() in its own session or its `with inference_session()`, batched.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Any

import torch
from transformers import GenerationConfig, GenerationMixin, PreTrainedModel
from transformers.generation.utils import GenerationMode
from transformers.modeling_outputs import CausalLMOutputWithPast

from swarm.client.arguments import check_loop_arguments, check_session_shape, checked_input_ids, loop_gives_the_same
from swarm.client.decode_batcher import DecodeBatcher
from swarm.client.drafters import DraftModels
from swarm.client.generate import Decoding, GenerationParams, Speculation, resolved_params, speculative_decode_loop
from swarm.client.head_batching import SharedHead
from swarm.client.metrics import ClientMetrics
from swarm.client.model_session import ModelSession
from swarm.client.remote_cache import CACHE_KWARG, SwarmCache, rows_by_padding
from swarm.client.sequential import RemoteSequential
from swarm.client.session import InferenceSession
from swarm.client.speculative import DraftLength
from swarm.client.view import SwarmView
from swarm.config import ClientConfig, check_speculative
from swarm.errors import CredentialsError, InvalidArgument, InvalidRequest
from swarm.partition import hf_config_of, load_client_head, open_checkpoint
from swarm.prefix_keys import TailMemory, new_salt
from swarm.registry import Registry
from swarm.registry.addresses import initial_peer_list
from swarm.router import Bans, MinLatencyRouter, WiringRouter
from swarm.types import Span

DEFAULT_CONTEXT_LENGTH = 8192  # for configs that do not say (peers allow this much per session by default)
ASSISTED_MARGIN = 64  # cache room past max_length for assisted decoding's candidates (transformers' default: 20)


class DistributedModelForCausalLM(PreTrainedModel, GenerationMixin):
    base_model_prefix = "swarm"
    main_input_name = "input_ids"

    def __init__(self, path: str | Path, initial_peers: str | Sequence[str], config: ClientConfig) -> None:
        if config.credentials is None:
            raise CredentialsError(
                "no swarm credentials: pass credentials=SwarmCredentials.load(DIR) (a private swarm's member) "
                "or credentials=SwarmCredentials.open() (an open swarm)"
            )
        checkpoint, _, block_config = open_checkpoint(path)  # a wrong path fails here, by name
        super().__init__(hf_config_of(checkpoint.path))
        if (Path(path) / "generation_config.json").is_file():  # what a local from_pretrained would use
            self.generation_config = GenerationConfig.from_pretrained(path)
        initial_peers = initial_peer_list(initial_peers)
        self.client_config, self.credentials = config, config.credentials
        self.num_blocks = block_config.num_layers
        self.context_length = int(getattr(self.config, "max_position_embeddings", None) or DEFAULT_CONTEXT_LENGTH)
        self.head = load_client_head(path)
        self.shared_head = SharedHead(self.head)  # generation's logits, batched across concurrent sessions
        self.decode_batcher = DecodeBatcher(self.head)  # generate()'s tokens, one loop for every thread's calls
        self.registry = Registry(initial_peers, host=config.dht_host, client_mode=True, credentials=self.credentials)
        name = config.model_name or Path(path).name
        self.prefix_salt = (config.prefix_salt or new_salt()) if config.prefix_cache else b""
        self.prefix_namespace, self.prefix_tails = name, TailMemory()
        self.metrics = ClientMetrics(name)
        self._draft_models = DraftModels()  # speculative="draft:PATH" models, loaded on first use
        port = config.metrics_port
        self.metrics_address = "" if port is None else self.metrics.serve(config.dht_host, port)
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
            compress_min_bytes=config.compress_min_bytes,
        )
        # Per thread and per asyncio task, not per object: asyncio.to_thread copies the caller's context into its
        # worker (a threading.local would not follow), and a new thread starts without one. Made per model so
        # that two models' sessions do not shadow each other; `with` resets it, so no context keeps a session alive.
        self._active: ContextVar[ModelSession | None] = ContextVar(f"swarm_active_session_{id(self)}", default=None)
        # The caches transformers' generate() made in this context, for generate() to close: None outside one.
        self._opened: ContextVar[list[SwarmCache] | None] = ContextVar(f"swarm_opened_{id(self)}", default=None)

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

    def open_session(self, batch_size: int, max_length: int, adapter: str = "") -> InferenceSession:
        """A session over every block, with this model's router, codec, timeouts and verification; with `adapter`,
        through peers that serve that LoRA adapter by name, which apply it to this session's rows."""
        config = self.client_config
        session = InferenceSession(
            self.router,
            self.view.peers,
            Span(0, self.num_blocks),
            batch_size,
            max_length,
            config.codec,
            config.step_timeout_s,
            config.max_failovers,
            config.push,
            self.metrics,
            credentials=self.credentials,
            wait_s=config.wait_for_blocks_s,
            compress_min_bytes=config.compress_min_bytes,
            stubs=self.view.stubs,
            adapter=adapter,
        )
        if config.verify_fraction > 0:
            session.enable_verification(config.verify_fraction, config.verify_margin)
        return session

    def new_cache(self, max_length: int) -> SwarmCache:
        """A cache on the peers for `model(ids, past_key_values=cache)` step by step (as transformers' StaticCache
        is used): up to `max_length` tokens per row, padding included. Close it (or use `with`) when done."""
        check_session_shape(max_length, 1, self.context_length)
        return SwarmCache(self.open_session, max_length)

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        past_key_values: SwarmCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        logits_to_keep: int = 0,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        cache: SwarmCache | None = None,
        **kwargs: Any,
    ) -> CausalLMOutputWithPast:
        """transformers' causal LM forward: logits [batch, seq, vocab] (the last `logits_to_keep` positions if > 0)
        and, with `labels`, the mean next-token cross-entropy (-100 ignored).

        With `past_key_values` (or `cache`, its name from transformers 5.24), a SwarmCache, the new tokens join the
        peers' caches; without, the blocks run as forward calls, differentiable with respect to the client's own
        parameters, as fine-tuning needs. Padding (zeros in `attention_mask`) is left out of every row, as a local
        model's mask does; position ids follow from the mask and other positional arguments are ignored.

        Raises:
            InvalidRequest: attentions or hidden states asked for (they stay on the peers), or a cache that is not
                a SwarmCache.
        """
        if output_attentions or output_hidden_states:
            raise InvalidRequest("attentions and hidden states of the blocks stay on the peers: they are not returned")
        if inputs_embeds is None:
            input_ids = checked_input_ids(input_ids, self.head.embed_tokens.num_embeddings)
            inputs_embeds = self.head.embed(input_ids)
        new = inputs_embeds.shape[1]
        mask = None if attention_mask is None or bool(attention_mask.all()) else attention_mask[:, -new:].bool()
        past_key_values = cache if cache is not None else past_key_values
        if isinstance(past_key_values, SwarmCache):
            hidden = past_key_values.run(inputs_embeds, mask)
        elif past_key_values is None:
            hidden = self._forward_without_cache(inputs_embeds, mask)
        else:
            kind = type(past_key_values).__name__
            raise InvalidRequest(f"past_key_values must be a SwarmCache (model.new_cache), got {kind}")
        logits = self.head.logits(hidden[:, -logits_to_keep:] if logits_to_keep else hidden)
        loss = None
        if labels is not None:
            shifted = logits[:, :-1].flatten(0, 1).float()
            loss = torch.nn.functional.cross_entropy(shifted, labels[:, 1:].flatten(), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{CACHE_KWARG: past_key_values})

    def get_input_embeddings(self) -> torch.nn.Embedding:
        return self.head.embed_tokens

    def _forward_without_cache(self, embeds: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """The blocks' outputs for embeds [batch, seq, hidden]; each distinct padding runs as its own batch of only
        the real tokens (zeros come out where a token is padding)."""
        if mask is None:
            return self.blocks(embeds)
        output = torch.zeros_like(embeds)
        for rows in rows_by_padding(mask):
            index, columns = torch.tensor(rows), mask[rows[0]].nonzero().squeeze(1)
            if columns.numel():
                result = self.blocks(embeds[index][:, columns])
                output = output.index_put((index[:, None], columns[None, :]), result)
        return output

    def inference_session(self, max_length: int, batch_size: int = 1, adapter: str = "") -> ModelSession:
        """`with model.inference_session(max_length=N) as s:` keeps the peers' KV caches between generate() calls;
        inside it, generate() takes only the new tokens of each turn. `adapter`: a LoRA adapter peers serve by name
        (`swarm peer join --adapters DIR`), applied to this session; "" for the bare model."""
        return ModelSession(self, max_length, batch_size, adapter)

    def generate(
        self,
        inputs: torch.Tensor | None = None,
        generation_config: GenerationConfig | None = None,
        logits_processor: Sequence[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] | None = None,
        stopping_criteria: Sequence[Callable[..., Any]] | None = None,
        streamer: Any | None = None,
        *,
        session: ModelSession | None = None,
        generator: torch.Generator | None = None,
        speculative: str | None = None,
        num_speculative_tokens: int | None = None,
        **kwargs: Any,
    ) -> Any:
        """transformers' generate, over the swarm: the same arguments (greedy, sampling, beam search, assisted
        decoding; every logits processor and stopping criterion; `generation_config`, `min_new_tokens`,
        `return_dict_in_generate` with scores and logits, streamers, left-padded batches with an attention mask)
        and the same results. Returns input_ids followed by the new tokens, [batch, n + new], or transformers'
        output object when `return_dict_in_generate`.

        RaySwarm's extensions run its own decoding loop, which takes the arguments in arguments.LOOP_ARGUMENTS plus the
        first four: `session` (or the calling thread's `with model.inference_session()`) continues that
        conversation; `generator` (a seeded torch.Generator) draws the samples, so a seed gives the same text
        whatever other threads do; `speculative` ("prompt_lookup", "draft:PATH"; "" for none; None:
        ClientConfig.speculative) drafts up to `num_speculative_tokens` tokens on the client and verifies them in
        one step through the swarm: the same tokens as without it when greedy, the same distribution when
        sampling, in fewer round trips. `speculation_stats()` counts drafted and accepted tokens. `adapter="name"` (a
        LoRA adapter peers serve, see inference_session) runs the new session with it, batched with others on peers.

        Thread-safe: concurrent calls run their own sessions, in the model's one loop where it gives the same tokens.

        Raises:
            InvalidArgument: bad input ids or sampling arguments, an unknown `speculative` kind, a draft path that
                is no checkpoint, or `num_speculative_tokens` out of [1, 32].
            InvalidRequest: an argument RaySwarm's loop does not take alongside one of its extensions, padding with
                an extension, or a session that another thread is generating in.
        """
        adapter, input_ids = kwargs.pop("adapter", ""), inputs if inputs is not None else kwargs.pop("input_ids", None)
        continuing = (session or self.active_session) is not None  # a turn in a session may add no tokens
        input_ids = checked_input_ids(input_ids, self.head.embed_tokens.num_embeddings, empty_ok=continuing)
        config = generation_config or self.generation_config
        params = resolved_params(input_ids.shape[1], config, kwargs)
        speculation = self._speculation(speculative, num_speculative_tokens)
        extended = (session or self.active_session or generator) is not None or bool(speculation[0] or adapter)
        if not extended and not loop_gives_the_same(config, logits_processor, stopping_criteria, kwargs):
            return self._generate_with_transformers(
                input_ids, generation_config, logits_processor, stopping_criteria, streamer, kwargs
            )
        check_loop_arguments(kwargs)
        if streamer is not None:
            streamer.put(input_ids)
        try:
            length = input_ids.shape[1] + params.max_new_tokens
            with self._session_for(session, input_ids.shape[0], length, adapter) as turn:
                extras = (streamer, logits_processor or (), stopping_criteria or (), generator)
                new = self._decode(turn, input_ids, params, speculation, extras)
        finally:
            if streamer is not None:
                streamer.end()
        return torch.cat([input_ids, new], dim=1)

    def _generate_with_transformers(
        self,
        input_ids: torch.Tensor,
        generation_config: GenerationConfig | None,
        logits_processor: Any,
        stopping_criteria: Any,
        streamer: Any,
        kwargs: dict[str, Any],
    ) -> Any:
        """GenerationMixin.generate with a SwarmCache (made by _prepare_cache_for_generation), closed afterwards."""
        opened: list[SwarmCache] = []
        token = self._opened.set(opened)
        try:
            return GenerationMixin.generate(
                self,
                input_ids,
                generation_config=generation_config,
                logits_processor=logits_processor,
                stopping_criteria=stopping_criteria,
                streamer=streamer,
                **kwargs,
            )
        finally:
            self._opened.reset(token)
            for cache in opened:
                cache.close()

    def _prepare_cache_for_generation(
        self, generation_config: GenerationConfig, model_kwargs: dict, generation_mode: Any, batch_size: int,
        max_cache_length: int,
    ) -> None:  # fmt: skip
        """transformers' hook for the cache of a generate() call: a SwarmCache, unless the caller passed a cache or
        use_cache=False (then every step runs the whole sequence as forward calls)."""
        if model_kwargs.get(CACHE_KWARG) is not None or generation_config.use_cache is False:
            return
        if generation_mode == GenerationMode.ASSISTED_GENERATION:  # the last candidates may run past max_length
            max_cache_length += ASSISTED_MARGIN
        cache = SwarmCache(self.open_session, min(max_cache_length, self.context_length))
        opened = self._opened.get()
        if opened is not None:
            opened.append(cache)
        model_kwargs[CACHE_KWARG] = cache

    @contextmanager
    def _session_for(
        self, session: ModelSession | None, batch_size: int, max_length: int, adapter: str
    ) -> Iterator[ModelSession]:
        """The session a generate() call runs in: `session`, else the calling thread's active one (held for the
        call), else a new one with `adapter` that no other call sees, closed afterwards."""
        session = session or self.active_session
        if session is not None:
            with session.turn(adapter):
                yield session
            return
        own = self.inference_session(max_length, batch_size, adapter)
        try:
            yield own
        finally:
            own.close()

    def _speculation(self, speculative: str | None, num_speculative_tokens: int | None) -> tuple[str, int]:
        """The speculative kind and draft length a generate() call asked for (ClientConfig's by default), checked."""
        kind = self.client_config.speculative if speculative is None else speculative
        k = self.client_config.num_speculative_tokens if num_speculative_tokens is None else num_speculative_tokens
        check_speculative(kind, k)
        if kind:
            self._draft_models.check(kind)
        return kind, k

    def _decode(
        self,
        session: ModelSession,
        input_ids: torch.Tensor,
        params: GenerationParams,
        speculation: tuple[str, int],
        extras: tuple[Any, Sequence[Callable], Sequence[Callable], torch.Generator | None],
    ) -> torch.Tensor:
        """The new tokens [batch, <= max_new_tokens] after input_ids, fed to `session` after last turn's last token;
        `extras`: the streamer, logits processors, stopping criteria and generator, as Decoding takes them."""
        feed = torch.cat([session.pending, input_ids], dim=1)
        kind, k = speculation
        if not kind:
            new = self.decode_batcher.decode(session, Decoding(session.tokens, feed, params, *extras))
        else:
            drafts = Speculation(
                self._draft_models.drafter_for(kind, self.head.lm_head.out_features),
                DraftLength(k),
                session.forget,
                self.metrics.count_drafts,
                lambda: session.max_length - session.position,
            )
            new = speculative_decode_loop(session.last_logits, session.tokens, feed, params, drafts, *extras)
        session.pending = new[:, -1:]
        return new

    def speculation_stats(self) -> dict[str, float]:
        """Speculative decoding so far on this model: drafted and accepted tokens and their ratio."""
        return self.metrics.speculation()

    def close(self) -> None:
        """Leave the swarm: the DHT node, the view's refresh thread, the metrics server and the channels."""
        self.blocks.close()
        self.view.close()
        self.registry.shutdown()
        self.metrics.close()
