"""Run Mixture-of-Experts models whose experts exceed memory: experts stream from disk under a budget.

The API below imports mlx and mlx-lm on first use, so the backend-neutral modules (cache,
policies, profiles, trace, replay, store) and the CLI's help import without them.
"""

from importlib.metadata import version

from . import stats as _stats_module  # noqa: F401  first: a later import would rebind `stats`

__version__ = version("mlx-moestream")
__all__ = ["load", "prewarm", "profile", "run_text", "save_profile", "save_trace", "start_trace",
           "stats"]


def stats(model) -> dict:
    """The session's cache and read statistics (see `loader.stats`)."""
    from .loader import stats as of_model

    return of_model(model)


def __getattr__(name: str):
    if name in __all__:
        from . import loader

        return getattr(loader, name)
    raise AttributeError(f"module 'mlx_moestream' has no attribute {name!r}")
