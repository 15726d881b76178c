"""The `chat` command: a model under a budget answers a prompt or an interactive chat.

The profile and trace a chat is asked for are checked before the model loads and saved however
the chat ends: done, interrupted, terminated, or failed mid-answer.
"""

from __future__ import annotations

import os
import signal
import sys
from functools import partial
from typing import Callable

import click

from .app import (Interrupted, Terminated, budget_option, check_torch_model, fail, finite,
                  for_the_session, mlx_backend, model_option, pin_share_option, policy_option,
                  prefetch_option, prewarm_share_option, profile_names, profile_option,
                  progress, tell, terminate_as_interrupt, torch_backend)
from .replies import mlx_reply, torch_reply
from .stats_view import format_hosts, format_stats
from .user_input import check_text, interactive, read_on_host_0


@click.command()
@model_option
@budget_option
@policy_option
@click.option("--prompt", help="Answer this one prompt and exit (non-interactive).")
@click.option("--max-tokens", "-n", type=click.IntRange(1), default=256, show_default=True)
@click.option("--temp", type=click.FloatRange(0), default=0.0, show_default=True,
              callback=finite,
              help="Sampling temperature; 0 is greedy.")
@profile_option
@prewarm_share_option
@pin_share_option
@click.option("--per-layer", is_flag=True,
              help="Split the budget per layer (by the loaded profile, else evenly).")
@prefetch_option
@click.option("--trace", "trace_path", type=click.Path(dir_okay=False),
              help="Record the routing to this .npz trace on exit.")
@click.option("--backend", type=click.Choice(["mlx", "torch"]), default="mlx", show_default=True,
              help="mlx: an mlx-lm model; torch: a transformers model (pip install "
                   "'mlx-moestream[torch]').")
@click.option("--device", default="cpu", show_default=True, help="The torch backend's device.")
@click.option("--distributed", is_flag=True,
              help="Under mlx.launch: the hosts share the experts, each streams its own under "
                   "its own budget; host 0 reads input and prints.")
def chat(model, budget, policy, prompt, max_tokens, temp, profiles, prewarm_share, pin_share,
         per_layer, prefetch, trace_path, backend, device, distributed):
    """Chat with a model; tokens stream as generated, cache statistics follow each answer."""
    from .. import session
    from ..profiles import save_target
    from ..trace import check_save_target

    profile, to_save = profile_names(profiles, prewarm_share, pin_share)
    check_torch_model(backend, model)
    if backend == "torch" and distributed:
        raise click.UsageError("--distributed needs --backend mlx")
    if backend == "mlx" and device != "cpu":  # else silently on MLX's own device
        raise click.UsageError("--device is the torch backend's (MLX runs on its default device)")
    if distributed and (profiles or trace_path is not None or per_layer or prefetch):
        raise click.UsageError("--distributed takes no --profile, --trace, --per-layer or "
                               "--prefetch yet")
    try:  # every output is checked before the session, not found unwritable at its end
        if prompt is not None:
            check_text(prompt, "--prompt")
        targets = [save_target(name) for name in to_save]
        if trace_path is not None:
            check_save_target(trace_path)
        paths = [*targets, *([trace_path] if trace_path is not None else [])]
        written = [os.path.realpath(t) for t in paths]
        if len(set(written)) < len(written):  # the second write would refuse, or replace, the first
            raise click.UsageError("--trace and each --profile save need a file of their own")
        with for_the_session():
            if backend == "torch":
                lm, tokenizer = torch_backend().load(
                    model, budget, device=device, policy=policy, profile=profile,
                    prewarm_share=prewarm_share, pin_share=pin_share, per_layer=per_layer,
                    prefetch=prefetch, progress=progress)
                reply = partial(torch_reply, lm, tokenizer, max_tokens, temp)
            else:
                lm, tokenizer = mlx_backend().load(
                    model, budget, policy, profile, prewarm_share=prewarm_share,
                    pin_share=pin_share, per_layer=per_layer, prefetch=prefetch,
                    progress=progress, distributed=distributed)
                reply = partial(mlx_reply, lm, tokenizer, max_tokens, temp)
        if distributed:
            _join_hosts(lm)
    except (ValueError, OSError, RuntimeError) as e:
        fail(e)
    if trace_path is not None:
        session.start_trace(lm)
    history: list[dict] = []

    def answer(text: str) -> None:
        check_text(text, "the message")
        message = {"role": "user", "content": text}
        text, timing = reply([*history, message])  # an answer cut short leaves no trace
        history.extend([message, {"role": "assistant", "content": text}])
        click.echo(format_stats(session.stats(lm), timing, host=0 if distributed else None))
        if distributed:
            click.echo(format_hosts(mlx_backend().host_stats(lm)))

    failed, stopped_by = None, None
    with terminate_as_interrupt() as ending:
        try:
            if prompt is not None:
                answer(prompt)
            elif distributed:
                # a host that failed or was interrupted mid-answer would leave the others waiting
                interactive(answer, partial(read_on_host_0, lm.moestream.backend.watchdog),
                            fatal=True)
            else:
                interactive(answer)
        except KeyboardInterrupt:  # ends an interactive chat; a --prompt answer is cut short
            tell("\n[interrupted]")
            stopped_by = signal.SIGINT if prompt is not None else None
        except Terminated as e:
            tell("\n[terminated]")
            stopped_by = e.signum
        except (ValueError, RuntimeError, OSError) as e:
            # a read error, a lost host, a closed terminal (EIO): the outputs are still written
            failed = e
        finally:
            ending()
            outputs = [(f"profile {t}", partial(session.save_profile, lm, t)) for t in targets]
            if trace_path is not None:
                outputs.append((f"trace {trace_path}",
                                partial(session.save_trace, lm, trace_path)))
            unsaved = _save_outputs(outputs)
    if failed:
        fail(failed)
    if unsaved:  # said above
        sys.exit(1)
    if stopped_by == signal.SIGINT:
        # a script running `chat --prompt` must not take a cut answer for a whole one
        raise Interrupted
    if stopped_by:  # as a shell reports a command a signal stopped
        sys.exit(128 + stopped_by)


def _join_hosts(lm) -> None:
    """Silence every host but host 0, since every host samples alike (see `mlx.hosts.join_hosts`)."""
    if lm.moestream.host[0]:
        sys.stdout = open(os.devnull, "w")


def _save_outputs(outputs: list[tuple[str, Callable[[], None]]]) -> bool:
    """Save each of `(label, save)` on its own, one failing losing none of the others.

    Returns:
        Whether one failed, which it said once.
    """
    unsaved = False
    for label, save in outputs:
        try:
            save()
            tell(f"{label} saved", err=True)
        except (ValueError, OSError) as e:
            tell(f"Error: {label} not saved: {e}", err=True)
            unsaved = True
    return unsaved
