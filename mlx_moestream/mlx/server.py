"""mlx-lm's OpenAI-compatible server with its one model loaded by `mlx_moestream.load`.

Follows `mlx_lm/server.py` of mlx-lm 0.32.2 (the version tested): its request handler, response
generator, prompt cache and batching serve as they are; `StreamedModelProvider` replaces the
load of a model, and `StreamedHandler` adds `/metrics` and `/v1/moestream/stats`, lists the one
model served, and refuses what that model cannot serve before it reaches the generator.
"""

from __future__ import annotations

import argparse
import json
import logging
import socket
import threading
from http.server import ThreadingHTTPServer
from typing import Callable

import mlx.core as mx
from mlx_lm.models.cache import LRUPromptCache, make_prompt_cache
from mlx_lm.server import APIHandler, ModelProvider, ResponseGenerator, get_system_fingerprint
from mlx_lm.utils import load as mlx_lm_load
from mlx_lm.utils import load_tokenizer
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest

from ..hub import resolve_model_path
from ..metrics import CacheCollector, cache_view
from .loading import load

DEFAULT_MODEL = "default_model"
GRACE_SECONDS = 30.0  # at the end, how long requests in flight may take to finish


class InFlight:
    """Counts the completion requests being answered, so that the end can wait for them."""

    def __init__(self):
        self.count = 0
        self.changed = threading.Condition()

    def __enter__(self) -> None:
        with self.changed:
            self.count += 1

    def __exit__(self, *exc) -> None:
        with self.changed:
            self.count -= 1
            self.changed.notify_all()

    def wait_done(self, seconds: float) -> bool:
        """Wait until none is in flight, at most `seconds`; whether none is."""
        with self.changed:
            return self.changed.wait_for(lambda: self.count == 0, seconds)


class ModelNotServed(ValueError):
    """A request named a model this server does not serve."""


class StreamedModelProvider(ModelProvider):
    """mlx-lm's `ModelProvider` holding one model whose experts stream under a budget.

    Its `_load` is stock's for one model and no adapter: the model comes from
    `mlx_moestream.load(**load_options)`, a draft model (which has no experts to stream) from
    mlx-lm. Another model is never loaded: a request naming one fails with `ModelNotServed`.
    """

    def __init__(self, cli_args: argparse.Namespace, load_options: dict):
        super().__init__(cli_args)
        self.load_options = load_options
        self.served = None  # the model, kept past `reset` (the generator's end) for the last save
        self.failure: Exception | None = None
        self.ready = threading.Event()  # set once the model loaded or failed to

    def load_default(self):
        """Load the model, keeping a failure for the command to report (stock logs it)."""
        try:
            super().load_default()
        except Exception as e:
            self.failure = e
        finally:
            self.ready.set()

    def load(self, model_path, adapter_path=None, draft_model_path=None):
        self.check(model_path, adapter_path, draft_model_path)
        return super().load(model_path, adapter_path, draft_model_path)

    def check(self, model_path, adapter_path=None, draft_model_path=None) -> None:
        """Raise `ModelNotServed` unless a request names the model loaded."""
        if model_path not in (DEFAULT_MODEL, self.cli_args.model):
            raise ModelNotServed(f"model '{model_path}' is not served here: this server serves "
                                 f"'{self.cli_args.model}' (or name it '{DEFAULT_MODEL}')")
        if adapter_path is not None:
            raise ModelNotServed("adapters are not served: the experts stream from the "
                                 "checkpoint as it is")
        if draft_model_path not in (DEFAULT_MODEL, self.cli_args.draft_model):
            raise ModelNotServed(f"draft model '{draft_model_path}' is not served here")

    def _load(self, model_path, adapter_path=None, draft_model_path=None):
        model, tokenizer = load(model_path, **self.load_options)
        if self.cli_args.chat_template:  # read again as stock reads it: its tool parser follows
            tokenizer = load_tokenizer(resolve_model_path(model_path), self._tokenizer_config,
                                       eos_token_ids=tokenizer.eos_token_ids)
        if self.cli_args.use_default_chat_template and tokenizer.chat_template is None:
            tokenizer.chat_template = tokenizer.default_chat_template
        draft_model = None
        if draft_model_path is not None:
            draft_model, draft_tokenizer = mlx_lm_load(draft_model_path)
            if draft_tokenizer.vocab_size != tokenizer.vocab_size:
                logging.warning("Draft model tokenizer does not match model tokenizer.")
        self.model_key = (model_path, adapter_path, draft_model_path)
        self.model, self.tokenizer, self.draft_model = model, tokenizer, draft_model
        self.processor = None  # a vision model's experts are not streamed
        self.is_batchable = draft_model is None and all(
            hasattr(c, "merge") for c in make_prompt_cache(model))
        self.served = model

    def context_tokens(self) -> int | None:
        """The model's context length from its config, if it names one."""
        return getattr(getattr(self.served, "args", None), "max_position_embeddings", None)


class StreamedResponseGenerator(ResponseGenerator):
    """Stock's generator refusing a prompt longer than the model's context, whose thread
    destroys its MLX streams before it ends."""

    def _run_generate(self):
        try:
            super()._run_generate()
        finally:
            # left to the thread's exit, MLX's teardown could abort the process as it exits
            mx.clear_streams()

    def _tokenize(self, tokenizer, request, args):
        tokenized = super()._tokenize(tokenizer, request, args)
        limit = self.model_provider.context_tokens()
        if limit is not None and len(tokenized[0]) >= limit:
            raise ValueError(f"the prompt has {len(tokenized[0])} tokens; the model's context "
                             f"holds {limit}")
        return tokenized


class StreamedHandler(APIHandler):
    """Stock's request handler with the cache's metrics and the one model served."""

    registry: CollectorRegistry
    requests: Counter

    def do_GET(self):
        path = self.path.split("?")[0]
        if path == "/metrics":
            self._reply(200, generate_latest(self.registry), CONTENT_TYPE_LATEST)
        elif path == "/v1/moestream/stats":
            model = self.response_generator.model_provider.served
            if model is None:
                self._error(503, "the model is still loading")
            else:
                self._reply(200, json.dumps(cache_view(model)).encode(), "application/json")
        else:
            super().do_GET()

    def handle_models_request(self):
        names = [self.response_generator.cli_args.model, DEFAULT_MODEL]
        models = [{"id": name, "object": "model", "created": self.created, "owned_by": "local"}
                  for name in names]
        self._reply(200, json.dumps({"object": "list", "data": models}).encode(),
                    "application/json")

    def validate_model_parameters(self) -> None:
        super().validate_model_parameters()
        limit = self.response_generator.model_provider.context_tokens()
        if limit is not None and self.max_tokens > limit:
            raise ValueError(f"max_tokens must be at most {limit}, the model's context")

    def handle_completion(self, request, stop_words):
        self.requests.labels(endpoint=self.path).inc()
        provider = self.response_generator.model_provider
        try:
            provider.check(self.requested_model, self.adapter, self.requested_draft_model)
        except ModelNotServed as e:
            self._error(404, str(e))
            return
        with self.server.in_flight:
            return super().handle_completion(request, stop_words)

    def _reply(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self._set_cors_headers()
        self.end_headers()
        self.wfile.write(body)

    def _error(self, status: int, message: str) -> None:
        self._reply(status, json.dumps({"error": message}).encode(), "application/json")

    def log_message(self, format, *args):
        logging.debug(format, *args)


def make_server(cli_args: argparse.Namespace, load_options: dict
                ) -> tuple[ThreadingHTTPServer, StreamedResponseGenerator]:
    """A server bound to `cli_args.host`:`cli_args.port` (not yet serving) and its generator,
    which then starts loading the model (as stock's `run`)."""
    family, _, _, _, address = socket.getaddrinfo(cli_args.host, cli_args.port,
                                                  type=socket.SOCK_STREAM,
                                                  flags=socket.AI_PASSIVE)[0]
    server_class = type("Server", (ThreadingHTTPServer,), {"address_family": family})
    server = server_class(address, APIHandler)  # bound first: a port in use loads nothing
    server.in_flight = InFlight()
    provider = StreamedModelProvider(cli_args, load_options)
    generator = StreamedResponseGenerator(provider,
                                          LRUPromptCache(cli_args.prompt_cache_size))
    registry = CollectorRegistry()
    registry.register(CacheCollector(lambda: provider.served))
    handler = type("Handler", (StreamedHandler,), {
        "registry": registry,
        "requests": Counter("moestream_requests", "Completion requests received.",
                            ["endpoint"], registry=registry)})
    fingerprint = get_system_fingerprint()
    server.RequestHandlerClass = lambda *a, **k: handler(generator, *a,
                                                         system_fingerprint=fingerprint, **k)
    return server, generator


def serve(server: ThreadingHTTPServer, generator: ResponseGenerator,
          every: tuple[float, Callable[[], None]] | None = None) -> None:
    """Serve until an exception (KeyboardInterrupt, a signal's) ends it, then close the socket,
    let the requests in flight finish (for `GRACE_SECONDS` at most: those left are cut off,
    as is every one at a second signal) and stop the generator.

    `every` = (seconds, call): `call` runs on its own thread every `seconds` meanwhile.
    """
    stopped = threading.Event()
    if every is not None:
        seconds, call = every
        threading.Thread(target=_repeat, args=(stopped, seconds, call), daemon=True).start()
    try:
        server.serve_forever()
    finally:
        stopped.set()
        server.server_close()
        try:
            server.in_flight.wait_done(GRACE_SECONDS)
        finally:
            generator.stop_and_join()


def _repeat(stopped: threading.Event, seconds: float, call: Callable[[], None]) -> None:
    while not stopped.wait(seconds):
        call()
