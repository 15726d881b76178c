"""The `profile` commands: list, record, show, merge and diff saved activation profiles."""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from ..files import open_regular
from .app import budget_option, fail, for_the_session, mlx_backend, model_option

if TYPE_CHECKING:
    from ..profiles import Profile


def load_profile(name: str) -> Profile:
    """The profile a name or a path gives (see `profiles.find`)."""
    from ..profiles import Profile, find

    return Profile.load(find(name))


@click.group()
def profile():
    """Saved workload activation profiles."""


@profile.command("list")
def profile_list():
    """Every profile found in ./profiles, the user directory and the package."""
    from ..profiles import Profile, list_all

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
    from .. import session
    from ..profiles import save_target

    try:  # the name, the destination and the text are checked before the model runs
        target = save_target(name)
        with open_regular(text_path, "cannot read the text") as f:
            data = f.read()
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{text_path}: not UTF-8 text ({e.reason} at byte {e.start})") \
                from None
        if not text.strip():
            raise ValueError(f"{text_path}: no text, so nothing to profile")
        backend = mlx_backend()
        with for_the_session():
            lm, tokenizer = backend.load(model, budget)
        tokens = backend.run_text(lm, tokenizer, text)
        click.echo(f"{tokens} tokens: {session.save_profile(lm, target)}")
    except (ValueError, OSError) as e:
        fail(e)


@profile.command("show")
@click.argument("name")
@click.option("--top", default=8, show_default=True, type=click.IntRange(min=1),
              help="Hot experts shown per layer.")
def profile_show(name, top):
    """Hot experts per layer and the share of activations the top-N carry."""
    from ..profiles import describe

    try:
        p = load_profile(name)
    except ValueError as e:
        fail(e)
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
    from ..profiles import merge, save_target

    try:
        target = save_target(output)
        merged = merge(load_profile(first), load_profile(second), workload=target.stem)
        click.echo(merged.save(target))
    except (ValueError, OSError) as e:
        fail(e)


@profile.command("diff")
@click.argument("first")
@click.argument("second")
@click.option("--top", default=8, show_default=True, type=click.IntRange(min=1))
def profile_diff(first, second, top):
    """Per layer: how differently two workloads route (JS divergence, top-N overlap)."""
    from ..profiles import diff

    try:
        rows = diff(load_profile(first), load_profile(second), top)
    except ValueError as e:
        fail(e)
    click.echo(f"{'layer':>5} {'JS div (bits)':>14} {f'top-{top} overlap':>15}")
    for r in rows:
        click.echo(f"{r['layer']:>5} {r['js_divergence']:>14.3f} {r['top_overlap']:>15.0%}")
