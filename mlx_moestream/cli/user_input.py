"""What a chat reads: lines of the terminal, each refused unless it is UTF-8.

Under `--distributed` host 0 reads the line and every host gets it.
"""

from __future__ import annotations

import io
import sys
from contextlib import AbstractContextManager, nullcontext
from typing import Callable

import click


def _read_line(prompt: str) -> str:
    """A line of the terminal, whose bytes that are not UTF-8 arrive as surrogates.

    `check_text` refuses such a line; decoded strictly, as under most locales, its bytes would
    end the chat, and a pipe's read-ahead lines with it.
    """
    if isinstance(sys.stdin, io.TextIOWrapper) and sys.stdin.errors == "strict":
        sys.stdin.reconfigure(errors="surrogateescape")
    return input(prompt)


def check_text(text: str, what: str) -> None:
    """Refuse `text` (named `what` in the error) that holds bytes that are not UTF-8.

    They arrive as surrogates, in argv or a line read, and no tokenizer takes them.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{what} is not UTF-8 text (at character {e.start})") from None


def interactive(answer: Callable[[str], None], read: Callable[[str], str] = _read_line,
                fatal: bool = False) -> None:
    """Answer lines until an empty one or Ctrl-D.

    Args:
        fatal: Let an interrupted or failed answer end the chat, which else reports it and
            goes on.
    """
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


def read_on_host_0(watchdog: AbstractContextManager, prompt: str) -> str:
    """Read a line on host 0 and give it to every host (EOFError on every host at its end).

    The others wait for it as long as the user takes; host 0 waits for them under `watchdog`.
    A line that is not UTF-8 is refused on host 0, which reads another.
    """
    import mlx.core as mx

    line, host_0 = None, mx.distributed.init().rank() == 0
    while host_0:
        try:
            line = _read_line(prompt)
            check_text(line, "the message")
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
