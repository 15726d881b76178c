"""`mlx-moestream`: chat with and inspect MoE models whose experts stream from disk.

Each command is a module of its own, added here to the group `main`; `app` holds what the
commands share. No module imports mlx or torch before a command runs, so the help starts
without them.
"""

from __future__ import annotations

import sys
import warnings

import click

from . import chat, inspect, profile, repack, replay, serve, top
from .app import PROGRAM, Commands, Interrupted, one_line_warning
from .stats_view import format_stats

__all__ = ["format_stats", "main", "run"]


@click.group(cls=Commands)
@click.version_option(package_name="mlx-moestream", prog_name="mlx-moestream")
def main() -> None:
    """Run Mixture-of-Experts models whose experts exceed memory."""
    warnings.formatwarning = one_line_warning


for command in (chat.chat, inspect.inspect, replay.replay, profile.profile, repack.repack,
                serve.serve, top.top):
    main.add_command(command)


def run() -> None:
    """Run `main` as the program `mlx-moestream`, ended by SIGINT where Ctrl-C stopped a command.

    The command leaves as a KeyboardInterrupt that shows no traceback, so that Python, once
    finalized, ends the process by SIGINT, as a shell expects: a loop in a script stops there,
    where status 130 would run its next round.
    """
    try:
        main(obj=PROGRAM)
    except Interrupted:
        hook = sys.excepthook
        sys.excepthook = lambda kind, *rest: (None if issubclass(kind, KeyboardInterrupt)
                                              else hook(kind, *rest))
        raise KeyboardInterrupt from None
