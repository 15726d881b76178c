import gc
import inspect
import os
import shutil
import sys
from pathlib import Path

import pytest

# OpenMP threads beyond an xdist worker's share of the cores spin-wait on cores others hold.
if "PYTEST_XDIST_WORKER" in os.environ:
    _WORKERS = int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // _WORKERS)))

# Commands the tests start (`mlx.launch`, `mlx-moestream`, `python`) are those of the venv whose
# python runs the tests, as in the README's activated venv, whether or not that venv is activated.
os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"


def pytest_collection_finish(session: pytest.Session) -> None:
    """Freeze what the imports hold (mlx-lm, transformers, torch, the test modules): it lives as
    long as the session, and each full collection walked it (7% of a worker's time)."""
    gc.freeze()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run the tests marked `long` first: run last, one xdist worker ran them while the others
    had nothing left to run."""
    items.sort(key=lambda item: item.get_closest_marker("long") is None)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """Build (once per session) a tiny model directory; same arguments give the same directory."""
    # imported here, not above: xdist's controller loads this file too, and runs no test
    from mlx_moestream.testing import make_tiny_moe

    root = tmp_path_factory.mktemp("models")
    built: dict[tuple, Path] = {}

    def build(arch: str = "qwen3_moe", **kwargs) -> Path:
        call = inspect.signature(make_tiny_moe).bind(None, arch, **kwargs)
        call.apply_defaults()  # `bits=None` builds what no `bits` builds: one directory
        key = tuple(sorted((k, repr(v)) for k, v in call.arguments.items() if k != "path"))
        if key not in built:
            built[key] = make_tiny_moe(root / f"m{len(built)}-{arch}", arch, **kwargs)
        return built[key]

    return build


@pytest.fixture
def model_copy(tiny_model, tmp_path):
    """A private copy of a tiny model, safe to corrupt."""

    def copy(arch: str = "qwen3_moe", **kwargs) -> Path:
        dst = tmp_path / "copy"
        shutil.copytree(tiny_model(arch, **kwargs), dst)
        return dst

    return copy


@pytest.fixture(scope="session")
def reference():
    """Stock mlx-lm logits of a model directory (see `testing.greedy_logits`)."""
    import mlx_lm

    from mlx_moestream.testing import greedy_logits

    cache = {}

    def get(path):
        if path not in cache:
            model, _ = mlx_lm.load(str(path))
            cache[path] = greedy_logits(model)
        return cache[path]

    return get
