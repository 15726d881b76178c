"""What the commands share: one-line errors, endings by signal, and common options.

Ctrl-C, SIGTERM and SIGHUP end a command as a script expects, a closed standard stream is
replaced, and a failed write of the output is one line. Imports neither mlx nor torch, so that
the CLI's help starts without them.
"""

from __future__ import annotations

import gc
import importlib
import math
import os
import signal
import sys
from contextlib import contextmanager
from types import ModuleType
from typing import Callable, ContextManager, Iterable, Iterator

import click

from ..budget import resolve_budget
from ..errors import BudgetError
from ..policies import DEFAULT_POLICY, POLICIES

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


model_option = click.option(
    "--model", "-m",
    help="Model directory or Hugging Face repo id (default: the embedded bilingual model).")

budget_option = click.option(
    "--budget", "-b", type=BudgetType(), default="auto", show_default=True,
    help="Memory for resident experts: bytes, 8GB, 512MiB, 35% of experts, auto.")

prewarm_share_option = click.option(
    "--prewarm-share", type=click.FloatRange(0, 1), default=1.0, show_default=True,
    help="Share of the budget a loaded profile pre-warms.")

pin_share_option = click.option(
    "--pin-share", type=click.FloatRange(0, 1), default=0.0, show_default=True,
    help="Share of the budget a loaded profile's hottest experts hold for good.")

policy_option = click.option(
    "--policy", "-p", default=DEFAULT_POLICY, show_default=True,
    help=f"Expert cache policy: {', '.join(sorted(LIVE_POLICIES))}; options as "
         "NAME:OPTION=VALUE,... (cyclic:half_life=128).")

profile_option = click.option(
    "--profile", "profiles", type=(click.Choice(["save", "load"]), str), multiple=True,
    metavar="save|load NAME",
    help="load NAME: pre-warm from a saved profile at start; save NAME: save the session's "
         "profile at its end. Both may be given.")

prefetch_option = click.option(
    "--prefetch", is_flag=True,
    help="Predict each next layer's experts and read them during compute.")


def finite(ctx: click.Context, param: click.Parameter, value: float) -> float:
    """Refuse NaN, which FloatRange lets through (every comparison with it is false), and inf."""
    if value is not None and not math.isfinite(value):
        raise click.BadParameter(f"{value} is not a finite number")
    return value


def profile_names(profiles: list[tuple[str, str]], prewarm_share: float, pin_share: float
                  ) -> tuple[str | None, list[str]]:
    """`--profile` pairs as (the NAME to load or None, the NAMEs to save), refusing a second
    load and pre-warm shares without a load, which would do nothing."""
    to_load = [name for action, name in profiles if action == "load"]
    if len(to_load) > 1:
        raise click.UsageError("--profile load may be given once")
    if not to_load and (pin_share or prewarm_share != 1.0):
        raise click.UsageError("--prewarm-share and --pin-share need --profile load NAME")
    return (to_load[0] if to_load else None), [n for action, n in profiles if action == "save"]


def fail(e: Exception) -> None:
    """Raise `e` as a one-line error, since a library's message may span lines.

    A closed output pipe (`| head`) is raised as it is: click ends quietly on it.
    """
    if isinstance(e, BrokenPipeError):
        raise e
    raise click.ClickException(" ".join(str(e).split()))


def tell(message: str, err: bool = False) -> None:
    """Echo a line about the session's end, or lose it with a terminal that closed.

    A closed terminal (SIGHUP, then EIO on every write) must not raise a traceback that stops
    the outputs from being saved.
    """
    try:
        click.echo(message, err=err)
    except OSError:
        pass


def progress(items: Iterable, label: str) -> ContextManager[Iterable]:
    """A progress bar over `items` on stderr, which leaves stdout to the command's output."""
    return click.progressbar(items, label=label, file=sys.stderr)


PROGRAM = "mlx-moestream"  # `run` passes it as the root context's `obj`


def torch_backend() -> ModuleType:
    """`mlx_moestream.torch`, or a ValueError saying how to install it."""
    try:
        return _backend("torch")
    except ImportError as e:
        raise ValueError(f"the torch backend needs torch and transformers 5 ({e}): "
                         "pip install 'mlx-moestream[torch]'") from None


def mlx_backend() -> ModuleType:
    """`mlx_moestream.mlx`, imported without torch when this process is the program.

    transformers (mlx-lm's tokenizers) imports torch whenever it is installed, which takes
    1.3 s of every start on a 2-core Xeon though no MLX command uses it. Run as the program
    (`run`), a command marks torch absent, as Python marks a module that failed to import, so
    transformers starts as it does where torch is not installed. A program that calls `main`
    keeps its modules as they are.
    """
    if _is_program():
        sys.modules.setdefault("torch", None)
    return _backend("mlx")


def _is_program() -> bool:
    ctx = click.get_current_context(silent=True)
    return ctx is not None and ctx.find_root().obj == PROGRAM


def _backend(name: str) -> ModuleType:
    module = f"mlx_moestream.{name}"
    if module in sys.modules:  # a later call would freeze the session's objects too
        return sys.modules[module]
    with for_the_session():
        return importlib.import_module(module)


@contextmanager
def for_the_session() -> Iterator[None]:
    """Make what lives as long as the process (a backend's modules, the model) with the
    collector paused, then freeze it (`gc.freeze`), when this process is the program.

    torch, transformers and mlx-lm create hundreds of thousands of such objects, and each full
    collection walked them all, while they were made and after: 0.7 s of a 4.7 s
    `chat --backend torch` on a 2-core machine. Frozen, no collection walks them again; the
    cyclic garbage made meanwhile stays (~9,000 objects in a torch chat, where collecting them
    first would cost 0.3 s). A program that calls `main` keeps its collector as it is.
    """
    if not _is_program():
        yield
        return
    from ..pipeline import gc_paused

    with gc_paused():
        yield
        gc.freeze()


def check_torch_model(backend: str, model: str | None) -> None:
    """Refuse the torch backend without `--model`: the embedded model is an MLX model."""
    if backend == "torch" and model is None:
        raise click.UsageError("--backend torch needs --model: the embedded model is an MLX model")


class Commands(click.Group):
    """The command group, ending a command as a script expects whatever stops it.

    Ctrl-C ends a command with `Interrupted`, status 130: click's "Aborted!" exits 1, which a
    script takes for an error of the command's own. An error writing the output is one line:
    click ends quietly on a closed pipe (EPIPE) but lets any other OSError out as a traceback
    (a full disk under `> file`, /dev/full). The commands' own OSErrors are theirs to say.
    """

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            tell("\n[interrupted]", err=True)
            raise Interrupted from None

    def main(self, *args, **kwargs):
        _open_standard_streams()
        try:
            return super().main(*args, **kwargs)
        except OSError as e:  # a file's error names it; the output's names none
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # none at exit
            where = e.filename or "cannot write the output"
            tell(f"Error: {where}: {e.strerror or e}", err=True)
            sys.exit(1)


class Interrupted(SystemExit):
    """Ctrl-C stopped a command, which said so.

    Status 130 where `main` is called by a program (a test's runner); `run` makes it the end of
    the process by SIGINT where it is the program.
    """

    def __init__(self):
        super().__init__(128 + signal.SIGINT)


def _open_standard_streams() -> None:
    """Give a standard stream closed at start (`<&-`) /dev/null to read and write.

    Else the next file opened takes its descriptor, and MLX refuses to load a file from
    descriptor 0 ("Failed to open file"). An interactive chat then reads the end of its input.
    """
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


def one_line_warning(message, category, filename, lineno, line=None) -> str:
    """A warning (a repacked copy ignored, say) as the CLI's errors read: one line, no source."""
    return f"Warning: {message}\n"


class Terminated(BaseException):
    """SIGTERM or SIGHUP (`signum`) ended the session.

    Its outputs are saved, then the process exits with 128 + `signum`, as one the signal ended.
    """

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


@contextmanager
def terminate_as_interrupt() -> Iterator[Callable[[], None]]:
    """Raise `Terminated` on SIGTERM and SIGHUP, which end a session where Ctrl-C stops an answer.

    Like Ctrl-C they wait for a cache step to end (`interrupts.DEFERRED`): cut short, its counts
    could be made twice when the outputs are saved.

    Yields:
        `ending`, to call once the session ends: from then on the signals change nothing (a
        terminal that closes sends SIGHUP after the reads that saw it closed), so that nothing
        cuts the saving of the outputs short.
    """
    ended = False

    def interrupt(signum, frame):
        if not ended:
            raise Terminated(signum)

    def ending() -> None:
        nonlocal ended
        ended = True

    previous = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield ending
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
