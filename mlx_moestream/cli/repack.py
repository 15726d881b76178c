"""The `repack` command: write, or verify, a model's expert-major copy of its experts."""

from __future__ import annotations

import click

from .app import Terminated, fail, model_option, progress, terminate_as_interrupt


@click.command()
@model_option
@click.option("--verify", "verify_only", is_flag=True,
              help="Only check an existing copy's checksums.")
def repack(model, verify_only):
    """Write an expert-major copy of the experts (one page-aligned read per expert) where every
    load of the model finds it: MODEL/moestream-experts, or the user cache for a model folder
    that is not writable."""
    from .. import repack as rp
    from ..hub import resolve_model_path
    from ..manifest import find_repacked

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
        with terminate_as_interrupt():  # its temporary file goes, as on Ctrl-C
            click.echo(rp.repack(path, progress=progress))
    except Terminated as e:
        stopped = click.ClickException("terminated: nothing was written")
        stopped.exit_code = 128 + e.signum
        raise stopped from None
    except (ValueError, OSError) as e:
        fail(e)
