"""`mlx-moestream`: chat with and inspect MoE models whose experts stream from disk."""

from __future__ import annotations

import io
import json
import math
import os
import signal
import sys
import time
import warnings
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable

import click
from jinja2 import TemplateError

from .budget import format_bytes, resolve_budget
from .errors import BudgetError
from .policies import DEFAULT_POLICY, POLICIES

LIVE_POLICIES = [name for name, cls in POLICIES.items() if not cls.offline]  # need no future


class BudgetType(click.ParamType):
    """`8GB`, `512MiB`, `35%`, `auto` or plain bytes; checked before any model is read."""

    name = "budget"

    def convert(self, value, param, ctx):
        if value is None or isinstance(value, int):
            return value
        text = str(value).strip()
        try:
            resolve_budget(text, expert_bytes=2**62, dense_bytes=0, memory_bytes=2**62)
        except BudgetError as e:
            self.fail(str(e), param, ctx)
        return int(text) if text.isdigit() else text


def _fail(e: Exception) -> None:
    """A one-line error: a library's message may span lines. A closed output pipe (`| head`)
    is no error to report: click ends quietly on it."""
    if isinstance(e, BrokenPipeError):
        raise e
    raise click.ClickException(" ".join(str(e).split()))


def _torch_backend():
    """`mlx_moestream.torch`, or a ValueError saying how to install it."""
    try:
        from . import torch as moestream_torch
    except ImportError as e:
        raise ValueError(f"the torch backend needs torch and transformers 5 ({e}): "
                         "pip install 'mlx-moestream[torch]'") from None
    return moestream_torch


model_option = click.option(
    "--model", "-m",
    help="Model directory or Hugging Face repo id (default: the embedded bilingual model).")


class _Commands(click.Group):
    """The commands, an error writing their output one line too: click ends quietly on a
    closed pipe (EPIPE) and lets any other OSError out as a traceback (a full disk under
    `> file`, /dev/full). The commands' own OSErrors are theirs to say (`_fail`). Ctrl-C ends
    a command with `_Interrupted`, status 130 (click's "Aborted!" exits 1, which a script takes
    for an error of the command's own)."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            _tell("\n[interrupted]", err=True)
            raise _Interrupted from None

    def main(self, *args, **kwargs):
        _open_standard_streams()
        try:
            return super().main(*args, **kwargs)
        except OSError as e:  # a file's error names it; the output's names none
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # none at exit
            where = e.filename or "cannot write the output"
            _tell(f"Error: {where}: {e.strerror or e}", err=True)
            sys.exit(1)


class _Interrupted(SystemExit):
    """Ctrl-C stopped a command, which said so: status 130 where `main` is called in a
    program (a test's runner), and the end of the process by SIGINT where it is the program
    (`run`)."""

    def __init__(self):
        super().__init__(128 + signal.SIGINT)


def run() -> None:
    """The program `mlx-moestream`: `main`, and a command Ctrl-C stopped leaves as a
    KeyboardInterrupt that shows no traceback, so that Python, once it has finalized, ends the
    process by SIGINT, as a shell expects of a command Ctrl-C stopped: a loop in a script
    stops there, where status 130 would run its next round."""
    try:
        main()
    except _Interrupted:
        hook = sys.excepthook
        sys.excepthook = lambda kind, *rest: (None if issubclass(kind, KeyboardInterrupt)
                                              else hook(kind, *rest))
        raise KeyboardInterrupt from None


def _open_standard_streams() -> None:
    """A standard stream closed at start (`<&-`) reads and writes /dev/null instead: the next
    file opened would take its descriptor, and MLX refuses to load a file from descriptor 0
    ("Failed to open file"). An interactive chat then reads the end of its input."""
    for fd, name, mode in ((0, "stdin", "r"), (1, "stdout", "w"), (2, "stderr", "w")):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_RDWR)
            if null != fd:
                os.dup2(null, fd)
                os.close(null)
        if getattr(sys, name) is None:  # what Python starts with for a closed one
            setattr(sys, name, open(fd, mode, closefd=False))


@click.group(cls=_Commands)
@click.version_option(package_name="mlx-moestream", prog_name="mlx-moestream")
def main() -> None:
    """Run Mixture-of-Experts models whose experts exceed memory."""
    warnings.formatwarning = _one_line_warning


def _one_line_warning(message, category, filename, lineno, line=None) -> str:
    """A warning (a repacked copy ignored, say) reads as the CLI's errors do: one line, no
    source location."""
    return f"Warning: {message}\n"


def _finite(ctx: click.Context, param: click.Parameter, value: float) -> float:
    """FloatRange lets NaN through (every comparison with it is false); inf is no number
    to sample with either."""
    if not math.isfinite(value):
        raise click.BadParameter(f"{value} is not a finite number")
    return value


budget_option = click.option(
    "--budget", "-b", type=BudgetType(), default="auto", show_default=True,
    help="Memory for resident experts: bytes, 8GB, 512MiB, 35% of experts, auto.")


@main.command()
@model_option
@budget_option
@click.option("--policy", "-p", default=DEFAULT_POLICY, show_default=True,
              help=f"Expert cache policy: {', '.join(sorted(LIVE_POLICIES))}; options as "
                   "NAME:OPTION=VALUE,... (cyclic:half_life=128).")
@click.option("--prompt", help="Answer this one prompt and exit (non-interactive).")
@click.option("--max-tokens", "-n", type=click.IntRange(1), default=256, show_default=True)
@click.option("--temp", type=click.FloatRange(0), default=0.0, show_default=True,
              callback=_finite,
              help="Sampling temperature; 0 is greedy.")
@click.option("--profile", "profiles", type=(click.Choice(["save", "load"]), str), multiple=True,
              metavar="save|load NAME",
              help="load NAME: pre-warm from a saved profile; save NAME: save this session's "
                   "profile on exit. Both may be given.")
@click.option("--prewarm-share", type=click.FloatRange(0, 1), default=1.0, show_default=True,
              help="Share of the budget a loaded profile pre-warms.")
@click.option("--pin-share", type=click.FloatRange(0, 1), default=0.0, show_default=True,
              help="Share of the budget a loaded profile's hottest experts hold for good.")
@click.option("--per-layer", is_flag=True,
              help="Split the budget per layer (by the loaded profile, else evenly).")
@click.option("--prefetch", is_flag=True,
              help="Predict each next layer's experts and read them during compute.")
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
    from . import session
    from .profiles import save_target
    from .trace import check_save_target

    to_load = [name for action, name in profiles if action == "load"]
    to_save = [name for action, name in profiles if action == "save"]
    if len(to_load) > 1:
        raise click.UsageError("--profile load may be given once")
    if not to_load and (pin_share or prewarm_share != 1.0):  # else silently without effect
        raise click.UsageError("--prewarm-share and --pin-share need --profile load NAME")
    if backend == "torch" and model is None:
        raise click.UsageError("--backend torch needs --model: the embedded model is an MLX model")
    if backend == "torch" and distributed:
        raise click.UsageError("--distributed needs --backend mlx")
    if backend == "mlx" and device != "cpu":  # else silently on MLX's own device
        raise click.UsageError("--device is the torch backend's (MLX runs on its default device)")
    if distributed and (profiles or trace_path or per_layer or prefetch):
        raise click.UsageError("--distributed takes no --profile, --trace, --per-layer or "
                               "--prefetch yet")
    try:  # every output is checked before the session, not found unwritable at its end
        if prompt is not None:
            _check_text(prompt, "--prompt")
        targets = [save_target(name) for name in to_save]
        if trace_path:
            check_save_target(trace_path)
        written = [os.path.realpath(t) for t in [*targets, *([trace_path] if trace_path else [])]]
        if len(set(written)) < len(written):  # the second write would refuse, or replace, the first
            raise click.UsageError("--trace and each --profile save need a file of their own")
        profile = to_load[0] if to_load else None
        if backend == "torch":
            lm, tokenizer = _torch_backend().load(model, budget, device=device, policy=policy,
                                                 profile=profile, prewarm_share=prewarm_share,
                                                 pin_share=pin_share, per_layer=per_layer,
                                                 prefetch=prefetch, progress=_progress)
            reply = partial(_torch_reply, lm, tokenizer, max_tokens, temp)
        else:
            from . import loader

            lm, tokenizer = loader.load(model, budget, policy, profile,
                                        prewarm_share=prewarm_share, pin_share=pin_share,
                                        per_layer=per_layer, prefetch=prefetch, progress=_progress,
                                        distributed=distributed)
            reply = partial(_mlx_reply, lm, tokenizer, max_tokens, temp)
        if distributed:
            _join_hosts(lm)
    except (ValueError, OSError, RuntimeError) as e:
        _fail(e)
    if trace_path:
        session.start_trace(lm)
    history: list[dict] = []

    def answer(text: str) -> None:
        _check_text(text, "the message")
        message = {"role": "user", "content": text}
        text, timing = reply([*history, message])  # an answer cut short leaves no trace
        history.extend([message, {"role": "assistant", "content": text}])
        click.echo(format_stats(session.stats(lm), timing, host=0 if distributed else None))
        if distributed:
            click.echo(_format_hosts(loader.host_stats(lm)))

    failed, stopped_by = None, None
    with _terminate_as_interrupt() as ending:
        try:
            if prompt is not None:
                answer(prompt)
            elif distributed:  # a host that failed or was interrupted mid-answer would leave
                _interactive(answer, partial(_read_on_host_0, lm.moestream.backend.watchdog),
                             fatal=True)  # the others waiting
            else:
                _interactive(answer)
        except KeyboardInterrupt:  # ends an interactive chat; a --prompt answer is cut short
            _tell("\n[interrupted]")
            stopped_by = signal.SIGINT if prompt is not None else None
        except _Terminated as e:
            _tell("\n[terminated]")
            stopped_by = e.signum
        except (ValueError, RuntimeError, OSError) as e:  # a read error, a lost host, a closed
            failed = e  # terminal (EIO): the outputs are still written
        finally:
            ending()
            outputs = [(f"profile {t}", partial(session.save_profile, lm, t)) for t in targets]
            if trace_path:
                outputs.append((f"trace {trace_path}",
                                partial(session.save_trace, lm, trace_path)))
            unsaved = _save_outputs(outputs)
    if failed:
        _fail(failed)
    if unsaved:  # said above
        sys.exit(1)
    if stopped_by == signal.SIGINT:  # a script running `chat --prompt` must not take a cut
        raise _Interrupted  # answer for a whole one
    if stopped_by:  # as a shell reports a command a signal stopped
        sys.exit(128 + stopped_by)


def _mlx_reply(lm, tokenizer, max_tokens: int, temp: float, history: list[dict]):
    """Stream an mlx-lm answer to `history`; returns its text and mlx-lm's last response."""
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_sampler

    tokens = _prompt_tokens(tokenizer, history, tokenizer.has_chat_template)
    reply = []
    for response in stream_generate(lm, tokenizer, tokens, max_tokens=max_tokens,
                                    sampler=make_sampler(temp=temp)):
        click.echo(response.text, nl=False)
        reply.append(response.text)
    click.echo()
    return "".join(reply), response


def _prompt_tokens(tokenizer, history: list[dict], templated: bool, **options) -> list[int]:
    """The conversation as prompt tokens, through the tokenizer's chat template. A base
    model's tokenizer has none: its turns' text as it is then, as `mlx_lm generate` does."""
    if templated:
        try:
            return tokenizer.apply_chat_template(history, add_generation_prompt=True, **options)
        except TemplateError as e:  # a template's own `raise_exception`, or one that is broken
            raise ValueError(f"the model's chat template failed: {e}") from None
    return tokenizer.encode("\n".join(turn["content"] for turn in history))


@dataclass
class _Timing:
    """What format_stats shows of a generation (the fields of mlx-lm's response)."""
    prompt_tokens: int
    prompt_tps: float
    generation_tokens: int
    generation_tps: float


def _torch_reply(lm, tokenizer, max_tokens: int, temp: float, history: list[dict]):
    """Stream a transformers `generate()` answer to `history`; returns its text and timing."""
    import torch
    from transformers import TextStreamer

    class Echo(TextStreamer):
        first = None  # when the first generated token came: the prompt's time ends there

        def put(self, value) -> None:
            if not self.next_tokens_are_prompt and self.first is None:
                self.first = time.perf_counter()
            super().put(value)

        def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
            click.echo(text, nl=stream_end)

    tokens = _prompt_tokens(tokenizer, history, tokenizer.chat_template is not None,
                            tokenize=True, return_dict=False)
    streamer = Echo(tokenizer, skip_prompt=True, skip_special_tokens=True)
    start = time.perf_counter()
    out = lm.generate(torch.tensor([tokens], device=lm.device), max_new_tokens=max_tokens,
                      do_sample=temp > 0, temperature=temp or None, streamer=streamer,
                      pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
    end, first = time.perf_counter(), streamer.first or time.perf_counter()
    generated = out.shape[-1] - len(tokens)
    text = tokenizer.decode(out[0, len(tokens):], skip_special_tokens=True)
    return text, _Timing(len(tokens), len(tokens) / max(first - start, 1e-9), generated,
                         generated / max(end - first, 1e-9))  # as mlx-lm counts it


def _save_outputs(outputs: list[tuple[str, Callable[[], None]]]) -> bool:
    """Save each of `(label, save)` on its own, one failing losing none of the others;
    whether one failed (each said once)."""
    unsaved = False
    for label, save in outputs:
        try:
            save()
            _tell(f"{label} saved", err=True)
        except (ValueError, OSError) as e:
            _tell(f"Error: {label} not saved: {e}", err=True)
            unsaved = True
    return unsaved


def _tell(message: str, err: bool = False) -> None:
    """A line about the session's end, which a closed terminal (SIGHUP, then EIO on every
    write) cannot show: lost, as the terminal is, rather than a traceback that stops the
    outputs from being saved."""
    try:
        click.echo(message, err=err)
    except OSError:
        pass


class _Terminated(BaseException):
    """SIGTERM or SIGHUP (`signum`): the session ends, its outputs saved, and the process
    exits with 128 + `signum`, as one the signal ended."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


@contextmanager
def _terminate_as_interrupt():
    """SIGTERM and SIGHUP end the session (its outputs saved), where Ctrl-C stops an answer.
    Like Ctrl-C they wait for a cache step to end (`interrupts.DEFERRED`): cut short, its
    counts could be made twice when the outputs are saved. Yields `ending`, to call once the
    session ends: from then on they change nothing (a terminal that closes sends SIGHUP after
    the reads that saw it closed), so that nothing cuts the saving of the outputs short."""
    ended = False

    def interrupt(signum, frame):
        if not ended:
            raise _Terminated(signum)

    def ending() -> None:
        nonlocal ended
        ended = True

    previous = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield ending
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _read_line(prompt: str) -> str:
    """A line of the terminal, whose bytes that are not UTF-8 arrive as surrogates for
    `_check_text` to refuse: decoded strictly, as under most locales, they would end the chat,
    and a pipe's read-ahead lines with them."""
    if isinstance(sys.stdin, io.TextIOWrapper) and sys.stdin.errors == "strict":
        sys.stdin.reconfigure(errors="surrogateescape")
    return input(prompt)


def _check_text(text: str, what: str) -> None:
    """Bytes that are not UTF-8 (in argv, or a line read) arrive as surrogates, which no
    tokenizer takes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{what} is not UTF-8 text (at character {e.start})") from None


def _interactive(answer, read=_read_line, fatal: bool = False) -> None:
    """Answer lines until an empty one or Ctrl-D; an interrupted or failed answer is reported
    and the chat goes on, unless `fatal`."""
    click.echo("Type a message; an empty line or Ctrl-D ends the chat.")
    while True:
        try:
            text = read(">>> ")
        except EOFError:
            click.echo()
            return
        if not text.strip():
            return
        try:
            answer(text)
        except KeyboardInterrupt:
            if fatal:
                raise
            click.echo("\n[interrupted]")
        except ValueError as e:  # a read error: this answer is lost, the session goes on
            if fatal:
                raise
            click.echo(f"\nError: {e}", err=True)


def _join_hosts(lm) -> None:
    """Only host 0 prints (every host samples alike: see `loader._join`)."""
    if lm.moestream.host[0]:
        sys.stdout = open(os.devnull, "w")


def _read_on_host_0(watchdog, prompt: str) -> str:
    """Host 0 reads a line and every host gets it (EOFError on every host at its end). The
    others wait for it as long as the user takes; host 0 waits for them under `watchdog`. A
    line that is not UTF-8 is refused on host 0, which reads another."""
    import mlx.core as mx

    line, host_0 = None, mx.distributed.init().rank() == 0
    while host_0:
        try:
            line = _read_line(prompt)
            _check_text(line, "the message")
            break
        except EOFError:
            break
        except ValueError as e:
            click.echo(f"Error: {e}", err=True)
    data = list(line.encode()) if line is not None else []
    with watchdog if host_0 else nullcontext():
        size = mx.distributed.all_sum(mx.array(len(data) + 1 if line is not None else 0)).item()
        if size == 0:
            raise EOFError
        text = mx.distributed.all_sum(mx.array(data + [0] * (size - 1 - len(data)), mx.int32))
        return bytes(text.tolist()).decode()


def _format_hosts(stats: dict) -> str:
    total = stats["combined"]
    hosts = ", ".join(f"host {i}: {h['hit_rate']:.1%} hits, "
                      f"{format_bytes(int(h['bytes_read']))} read"
                      for i, h in enumerate(stats["hosts"]))
    return (f"all {len(stats['hosts'])} hosts: hit rate {total['hit_rate']:.1%}, "
            f"{int(total['loads'])} loads, read {format_bytes(int(total['bytes_read']))} ({hosts})")


def _progress(items, label: str):
    return click.progressbar(items, label=label, file=sys.stderr)


def format_stats(s: dict, response=None, host: int | None = None) -> str:
    """A short table: totals, then one line per MoE layer; `host`: the host whose experts
    they are, under expert parallelism."""
    lines = []
    if response is not None:
        lines.append(
            f"[{response.prompt_tokens} prompt tokens at {response.prompt_tps:.1f} tok/s, "
            f"{response.generation_tokens} generated at {response.generation_tps:.1f} tok/s]"
        )
    whose = "experts" if host is None else f"host {host} experts"
    lines.append(
        f"{whose}, session so far: hit rate {s['hit_rate']:.1%} ({s['hits']} hits, "
        f"{s['misses']} misses), "
        f"{s['loads']} loads, {s['evictions']} evictions, read {format_bytes(s['bytes_read'])} "
        f"in {s['read_ms']:.0f} ms; resident {format_bytes(s['resident_bytes'])} of budget "
        f"{format_bytes(s['budget_bytes'])} ({s['policy']})"
    )
    if s["prewarm"]:
        w = s["prewarm"]
        lines.append(f"pre-warmed {w['experts']} experts from profile '{w['profile']}' "
                     f"({format_bytes(w['bytes'])} in {w['read_ms']:.0f} ms), {w['pinned']} pinned; "
                     f"hit rate since {_percent(w['hit_rate_after'])}"
                     + ("" if w["hit_rate_before"] is None
                        else f", before it {_percent(w['hit_rate_before'])}"))
    if s["prefetch"]:
        lines.append(f"prefetch: {s['prefetch_loads']} reads, {s['prefetch_used']} used; "
                     f"prediction precision {_percent(s['prediction_precision'])}, recall "
                     f"{_percent(s['prediction_recall'])}; stalled {s['stall_ms']:.0f} ms")
    windows = s["hit_rate_windows"][-8:]
    if windows:
        lines.append("hit rate per window: " + " ".join(f"{w['hit_rate']:.0%}" for w in windows))
    lines.append(f"{'layer':>5} {'hits':>7} {'misses':>7} {'hit%':>6} {'evict':>7} {'unique':>6} "
                 f"{'warm':>5} {'pinned':>6}")
    for i, layer in enumerate(s["layers"]):
        lines.append(
            f"{i:>5} {layer['hits']:>7} {layer['misses']:>7} {layer['hit_rate']:>6.1%} "
            f"{layer['evictions']:>7} {layer['unique_experts']:>6} {layer['warm']:>5} "
            f"{layer['pinned']:>6}"
        )
    return "\n".join(lines)


def _percent(rate: float | None) -> str:
    return "-" if rate is None else f"{rate:.1%}"


@main.command()
@model_option
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.option("--hosts", type=click.IntRange(1), default=1, show_default=True,
              help="Hosts sharing the experts (chat --distributed): the minimum budget per host.")
@click.option("--backend", type=click.Choice(["mlx", "torch"]), default="mlx", show_default=True,
              help="The backend to plan for: torch computes a layer's call at once, so its "
                   "minimum budget holds every expert of one layer.")
def inspect(model, as_json, hosts, backend):
    """Architecture, experts, bytes per expert, dense bytes and the minimum budget."""
    from .hub import resolve_model_path
    from .loader import load_lazy

    if backend == "torch" and model is None:
        raise click.UsageError("--backend torch needs --model: the embedded model is an MLX model")
    if backend == "torch" and hosts > 1:
        raise click.UsageError("--hosts needs --backend mlx")
    try:
        if backend == "torch":
            plan = _torch_backend().plan_of(model)
            info = {**plan.describe(), "min_budget_bytes": plan.budget_holding(),
                    "min_budget_bytes_per_layer": plan.budget_holding(per_layer=True)}
        else:
            plan = load_lazy(resolve_model_path(model))[-1]
            info = plan.describe()
        if hosts > 1:
            shares = [plan.host_share(h, hosts) for h in range(hosts)]
            info["hosts"] = hosts
            info["min_budget_bytes_per_host"] = max(p.min_budget_bytes for p in shares)
    except (ValueError, OSError) as e:
        _fail(e)
    if as_json:
        json.dump(info, sys.stdout, indent=2)
        click.echo()
        return
    names = {"moe_layers": "MoE layers", "top_k": "top-k", "expert_bytes": "bytes per expert",
             "all_expert_bytes": "all experts", "dense_bytes": "dense weights",
             "min_budget_bytes": "minimum budget",
             "min_budget_bytes_per_layer": "with --per-layer",
             "min_budget_bytes_per_host": "minimum per host",
             "smallest_expert_bytes": "smallest expert"}
    if "smallest_expert_bytes" in info:
        names["expert_bytes"] = "largest expert"
    for key, value in info.items():
        label = names.get(key, key.replace("_", " "))
        shown = f"{format_bytes(value)} ({value} bytes)" if "_bytes" in key else value
        click.echo(f"{label:>17}: {shown}")


def _capacity(text: str) -> int | float:
    try:
        return int(text)
    except ValueError:
        try:
            return float(text)
        except ValueError:
            raise click.BadParameter(f"'{text}' is neither a slot count nor a fraction") from None


def _load_profile(name: str):
    from .profiles import Profile, find

    return Profile.load(find(name))


@main.command()
@click.argument("trace_path", metavar="TRACE", type=click.Path(exists=True, dir_okay=False))
@click.option("--policy", "-p", default=DEFAULT_POLICY, show_default=True,
              help="A policy, with options as NAME:OPTION=VALUE,... (cyclic:half_life=128).")
@click.option("--capacity", "-c", default="0.25", show_default=True,
              help="(layer, expert) slots, or a fraction of all of them (0.25).")
@click.option("--per-layer", is_flag=True, help="Split the slots evenly per layer.")
@click.option("--profile", "profile_name", help="Seed the policy with this profile's counts.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.option("--sweep", is_flag=True, help="Every policy over a range of capacities.")
@click.option("--plot", type=click.Path(dir_okay=False), help="With --sweep: write a PNG plot.")
def replay(trace_path, policy, capacity, per_layer, profile_name, as_json, sweep, plot):
    """Replay a routing trace through the runtime's cache policies; compare with LRU and Belady."""
    from . import replay as rp
    from .policies import POLICIES
    from .trace import Trace

    if plot and not sweep:
        raise click.UsageError("--plot draws the --sweep: give both")
    try:
        if plot:  # checked before the sweep, not found unwritable after it
            rp.check_plot_target(plot)
        trace = Trace.load(trace_path)
        profile = None
        if profile_name:
            profile = _load_profile(profile_name)
            profile.check_shape({"moe_layers": trace.layers, "experts": trace.num_experts},
                                target="the trace")
        if sweep:  # the capacities that hold one token's experts
            capacities = [c for c in (0.05, 0.1, 0.25, 0.5, 0.75, 1.0)
                          if rp.fits(trace, c, per_layer)]
            results = rp.sweep(trace, sorted(POLICIES), capacities or [1.0], per_layer, profile)
        else:
            results = [rp.replay(trace, policy, _capacity(capacity), per_layer, profile)]
    except ValueError as e:
        _fail(e)
    if plot and not rp.plot_sweep(results, plot):
        _fail(RuntimeError("--plot needs matplotlib (pip install matplotlib): no plot written"))
    if as_json:
        click.echo(json.dumps(results if sweep else results[0], indent=2))
        return
    click.echo(f"{'policy':>8} {'slots':>7} {'hit rate':>9} {'lru':>7} {'belady':>7} {'evictions':>10}")
    for r in results:
        click.echo(f"{r['policy']:>8} {r['capacity']:>7} {r['hit_rate']:>9.2%} "
                   f"{r['lru_hit_rate']:>7.2%} {r['belady_hit_rate']:>7.2%} {r['evictions']:>10}")


@main.group()
def profile():
    """Saved workload activation profiles."""


@profile.command("list")
def profile_list():
    """Every profile found in ./profiles, the user directory and the package."""
    from .profiles import Profile, list_all

    for path in list_all():
        try:
            p = Profile.load(path)
        except ValueError as e:
            click.echo(f"{path.stem:<20} (unreadable: {e})")
            continue
        click.echo(f"{path.stem:<20} {str(p.model.get('model_type')):<12} {p.tokens:>8} tokens"
                   f"  {p.created}  {path}")


@profile.command("record")
@click.argument("name")
@click.option("--text", "text_path", required=True, type=click.Path(exists=True, dir_okay=False),
              help="A text file typical of the workload.")
@model_option
@budget_option
def profile_record(name, text_path, model, budget):
    """Record a workload's profile by running a text through the model (its counts are the
    same at every budget)."""
    from . import loader, session
    from .profiles import save_target

    try:  # the name, the destination and the text are checked before the model runs
        target = save_target(name)
        try:
            text = Path(text_path).read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{text_path}: not UTF-8 text ({e.reason} at byte {e.start})") \
                from None
        if not text.strip():
            raise ValueError(f"{text_path}: no text, so nothing to profile")
        lm, tokenizer = loader.load(model, budget)
        tokens = loader.run_text(lm, tokenizer, text)
        click.echo(f"{tokens} tokens: {session.save_profile(lm, target)}")
    except (ValueError, OSError) as e:
        _fail(e)


@profile.command("show")
@click.argument("name")
@click.option("--top", default=8, show_default=True, type=click.IntRange(min=1),
              help="Hot experts shown per layer.")
def profile_show(name, top):
    """Hot experts per layer and the share of activations the top-N carry."""
    from .profiles import describe

    try:
        p = _load_profile(name)
    except ValueError as e:
        _fail(e)
    click.echo(f"workload {p.workload}: {p.tokens} tokens on {describe(p.model)}, "
               f"created {p.created}")
    coverage = p.coverage(top)
    for layer, (counts, share) in enumerate(zip(p.counts, coverage)):
        hot = [int(e) for e in counts.argsort(kind="stable")[::-1][:top] if counts[e] > 0]
        click.echo(f"layer {layer:>3}: top-{top} carry {share:6.1%}  hot {hot}")


@profile.command("merge")
@click.argument("first")
@click.argument("second")
@click.option("-o", "--output", required=True, help="Name or path of the merged profile.")
def profile_merge(first, second, output):
    """Sum two profiles of the same model."""
    from .profiles import merge, save_target

    try:
        target = save_target(output)
        merged = merge(_load_profile(first), _load_profile(second), workload=target.stem)
        click.echo(merged.save(target))
    except (ValueError, OSError) as e:
        _fail(e)


@profile.command("diff")
@click.argument("first")
@click.argument("second")
@click.option("--top", default=8, show_default=True, type=click.IntRange(min=1))
def profile_diff(first, second, top):
    """Per layer: how differently two workloads route (JS divergence, top-N overlap)."""
    from .profiles import diff

    try:
        rows = diff(_load_profile(first), _load_profile(second), top)
    except ValueError as e:
        _fail(e)
    click.echo(f"{'layer':>5} {'JS div (bits)':>14} {f'top-{top} overlap':>15}")
    for r in rows:
        click.echo(f"{r['layer']:>5} {r['js_divergence']:>14.3f} {r['top_overlap']:>15.0%}")


@main.command()
@model_option
@click.option("--verify", "verify_only", is_flag=True, help="Only check an existing copy's checksums.")
def repack(model, verify_only):
    """Write an expert-major copy of the experts (one page-aligned read per expert) where every
    load of the model finds it: MODEL/moestream-experts, or the user cache for a model folder
    that is not writable."""
    from . import repack as rp
    from .hub import resolve_model_path
    from .manifest import find_repacked

    try:
        path = resolve_model_path(model)
        folder = find_repacked(path)
        if verify_only:
            problems = rp.verify(folder, path)
            for problem in problems:
                click.echo(problem, err=True)
            if problems:
                raise click.ClickException(f"{folder}: {len(problems)} problems found")
            click.echo(f"{folder}: every expert block matches its checksum")
            return
        with _terminate_as_interrupt():  # its temporary file goes, as on Ctrl-C
            click.echo(rp.repack(path, progress=_progress))
    except _Terminated as e:
        stopped = click.ClickException("terminated: nothing was written")
        stopped.exit_code = 128 + e.signum
        raise stopped from None
    except (ValueError, OSError) as e:
        _fail(e)


if __name__ == "__main__":
    run()
