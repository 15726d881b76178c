"""Run Mixture-of-Experts models whose experts exceed memory: experts stream from disk under a budget.

`load` and `run_text` import mlx and mlx-lm on first use; the rest of the API (`session`) and
the backend-neutral modules (runtime, cache, policies, profiles, trace, replay, store) never
do, so a torch user (`mlx_moestream.torch.load`) and the CLI's help import without them.
"""

from importlib.metadata import PackageNotFoundError, version

from . import stats as _stats_module  # noqa: F401  first: a later import would rebind `stats`
from .errors import MoestreamError

try:
    __version__ = version("mlx-moestream")
except PackageNotFoundError:  # imported from a plain checkout, as the scripts allow
    __version__ = "0+checkout"
__all__ = ["MoestreamError", "host_stats", "load", "prewarm", "profile", "run_text",
           "save_profile", "save_trace", "start_trace", "stats"]


def stats(model) -> dict:
    """The session's cache and read statistics (see `session.stats`)."""
    from .session import stats as of_model

    return of_model(model)


def __getattr__(name: str):
    if name in ("host_stats", "load", "run_text"):
        from . import mlx

        return getattr(mlx, name)
    if name in __all__:
        from . import session

        return getattr(session, name)
    raise AttributeError(f"module 'mlx_moestream' has no attribute {name!r}")
