"""The `serve` command: mlx-lm's OpenAI-compatible server with the experts streamed.

The server is `mlx_lm.server`'s (see `mlx.server`); the profile it is asked to save is checked
before the model loads, saved every `--save-every` minutes, and saved once more however the
server ends (Ctrl-C, SIGTERM, SIGHUP).
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys

import click

from .app import (Interrupted, Terminated, budget_option, fail, finite, for_the_session,
                  mlx_backend, model_option, pin_share_option, policy_option, prefetch_option,
                  prewarm_share_option, profile_names, profile_option, tell,
                  terminate_as_interrupt)


@click.command()
@model_option
@budget_option
@policy_option
@profile_option
@prewarm_share_option
@pin_share_option
@click.option("--save-every", type=click.FloatRange(min=0, min_open=True),
              help="Minutes between saves of --profile save.  [default: 10]")
@prefetch_option
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on; anything but loopback exposes the model to the "
                   "network, with no authentication.")
@click.option("--port", type=click.IntRange(0, 65535), default=8080, show_default=True)
@click.option("--max-tokens", type=click.IntRange(1), default=512, show_default=True,
              help="Default max_tokens of a request.")
@click.option("--temp", type=click.FloatRange(0), default=0.0, show_default=True,
              callback=finite, help="Default sampling temperature.")
@click.option("--chat-template", default="", help="A chat template replacing the model's.")
@click.option("--chat-template-args", default="{}", show_default=True,
              help="JSON arguments of the chat template ('{\"enable_thinking\":false}').")
@click.option("--draft-model", help="An mlx-lm model for speculative decoding (not streamed).")
@click.option("--num-draft-tokens", type=click.IntRange(1), default=3, show_default=True)
@click.option("--prompt-cache-size", type=click.IntRange(1), default=10, show_default=True,
              help="Distinct KV caches the prompt cache holds.")
@click.option("--decode-concurrency", type=click.IntRange(1), default=32, show_default=True,
              help="Requests decoded together in a batch.")
@click.option("--prompt-concurrency", type=click.IntRange(1), default=8, show_default=True,
              help="Prompts processed together in a batch.")
@click.option("--log-level", type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"]),
              default="WARNING", show_default=True)
def serve(model, budget, policy, profiles, prewarm_share, pin_share, save_every, prefetch, host,
          port, max_tokens, temp, chat_template, chat_template_args, draft_model,
          num_draft_tokens, prompt_cache_size, decode_concurrency, prompt_concurrency, log_level):
    """Serve a model at /v1/chat/completions and /v1/completions (OpenAI's API, mlx_lm.server's
    machinery), its cache's metrics at /metrics."""
    from .. import session
    from ..profiles import save_target

    to_load, to_save = profile_names(profiles, prewarm_share, pin_share)
    if len(to_save) > 1:
        raise click.UsageError("--profile save may be given once")
    if save_every is not None and not to_save:  # else silently without effect
        raise click.UsageError("--save-every needs --profile save NAME")
    try:
        template_args = json.loads(chat_template_args)
    except json.JSONDecodeError as e:
        raise click.BadParameter(f"not JSON: {e}", param_hint="--chat-template-args") from None
    logging.basicConfig(level=log_level, format="%(levelname)s: %(message)s")
    cli_args = argparse.Namespace(
        model=model or "embedded", adapter_path=None, host=host, port=port,
        allowed_origins=["*"], draft_model=draft_model, num_draft_tokens=num_draft_tokens,
        trust_remote_code=False, chat_template=chat_template, use_default_chat_template=False,
        temp=temp, top_p=1.0, top_k=0, min_p=0.0, max_tokens=max_tokens,
        chat_template_args=template_args, decode_concurrency=decode_concurrency,
        prompt_concurrency=prompt_concurrency, prefill_step_size=2048,
        prompt_cache_size=prompt_cache_size, prompt_cache_bytes=None, kv_bits=None,
        kv_group_size=64, quantized_kv_start=0, pipeline=False)
    try:
        target = save_target(to_save[0]) if to_save else None
        mlx_backend()  # first, so that the server's imports leave torch out
        from ..mlx.server import make_server, serve as serve_forever

        server, generator = make_server(cli_args, dict(
            budget=budget, policy=policy, profile=to_load,
            prewarm_share=prewarm_share, pin_share=pin_share, prefetch=prefetch))
    except (ValueError, OSError, RuntimeError) as e:
        fail(e)
    provider = generator.model_provider
    with for_the_session():  # the generator's thread loads the model meanwhile
        try:
            provider.ready.wait()
        except KeyboardInterrupt:  # the generator's thread ends once the load has
            provider.failure = KeyboardInterrupt()
    if provider.failure is not None:
        server.server_close()
        generator.stop_and_join()
        if isinstance(provider.failure, KeyboardInterrupt):
            raise provider.failure
        fail(provider.failure)

    def save(final: bool) -> None:
        try:
            session.save_profile(provider.served, target)
        except ValueError as e:  # no token routed yet: an earlier profile stays
            if final:
                tell(f"profile {to_save[0]} not saved: {e}", err=True)
        except OSError as e:
            tell(f"Error: profile {to_save[0]} not saved: {e}", err=True)
        else:
            if final:
                tell(f"profile {to_save[0]} saved", err=True)

    address = server.server_address
    tell(f"serving {cli_args.model} at http://{address[0]}:{address[1]}/v1", err=True)
    stopped_by = None
    with terminate_as_interrupt() as ending:
        try:
            serve_forever(server, generator,
                          ((save_every or 10.0) * 60, lambda: save(False)) if target else None)
        except KeyboardInterrupt:
            stopped_by = signal.SIGINT
        except Terminated as e:
            stopped_by = e.signum
        finally:
            ending()
            if target:
                save(True)
    tell("[stopped]", err=True)
    if stopped_by == signal.SIGINT:
        raise Interrupted
    sys.exit(128 + stopped_by)
