"""Load time with a budget against stock mlx-lm, for models of 1k to 24k small experts. Prints JSON.

Each model is a tiny random 4-bit qwen3_moe (64 experts per layer, 16 to 384 layers) built
locally. Every load runs in a fresh process, the model's pages dropped from the page cache first
where the OS allows (Linux), and is timed, imports excluded, to the end of reading every weight
it reads: stock `mlx_lm.load` then `mx.eval` of all parameters; mlx-moestream's `load` at a 100%
budget (every expert read at load) and at 25% (dense weights only). `ratio` is the median
mlx-moestream time over the median stock time, measured in the same run;
`ratio_to_stock_gc_paused` the same against stock run with the garbage collector paused, as
mlx-moestream's load pauses it.

    python scripts/bench_load.py --layers 16 --layers 96 --layers 192 --layers 384
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import click

# Run from a plain checkout as well as from an installed package.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mlx_moestream.testing import make_tiny_moe  # noqa: E402

EXPERTS = 64
# imported before the clock starts, mlx_moestream's lazy API included
IMPORTS = ("import mlx.core as mx, mlx_lm, mlx_moestream; from mlx.utils import tree_flatten; "
           "mlx_moestream.load")
STOCK = "m, _ = mlx_lm.load(sys.argv[1]); mx.eval([a for _, a in tree_flatten(m.parameters())])"
TIMED = {
    "stock": STOCK,
    # mlx-moestream pauses Python's cyclic garbage collector while it loads: stock with the same
    # pause shows what is left of the difference once that is taken out
    "stock-gc-paused": f"import gc; gc.disable(); {STOCK}",
    "100%": "mlx_moestream.load(sys.argv[1], budget='100%')",
    "25%": "mlx_moestream.load(sys.argv[1], budget='25%')",
}


def drop_page_cache(path: Path) -> None:
    """Evict the model's files from the page cache, so every load reads from the disk."""
    for file in path.rglob("*.safetensors"):
        fd = os.open(file, os.O_RDONLY)
        try:
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def time_load(kind: str, path: Path) -> float:
    drop_page_cache(path)
    code = (f"import sys, time; {IMPORTS}; t = time.perf_counter(); {TIMED[kind]}; "
            f"print(time.perf_counter() - t)")
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True,
                         check=True)
    return float(out.stdout.strip().splitlines()[-1])


@click.command()
@click.option("--layers", "layer_counts", type=int, multiple=True, default=(16, 96, 192, 384),
              show_default=True, help="MoE layers of each model (64 experts each).")
@click.option("--repeats", type=int, default=3, show_default=True)
def main(layer_counts: tuple[int, ...], repeats: int) -> None:
    results = []
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as folder:
        for layers in layer_counts:
            with contextlib.redirect_stdout(sys.stderr):  # mlx-lm's quantization notice
                path = make_tiny_moe(Path(folder) / f"m{layers}", "qwen3_moe", bits=4,
                                     num_layers=layers, num_experts=EXPERTS, top_k=2)
            click.echo(f"{layers * EXPERTS} experts", err=True)
            seconds = {kind: statistics.median(time_load(kind, path) for _ in range(repeats))
                       for kind in TIMED}
            results.append({
                "experts": layers * EXPERTS, "layers": layers,
                "seconds": {k: round(v, 3) for k, v in seconds.items()},
                "ratio": {k: round(seconds[k] / seconds["stock"], 3) for k in ("100%", "25%")},
                "ratio_to_stock_gc_paused": {k: round(seconds[k] / seconds["stock-gc-paused"], 3)
                                             for k in ("100%", "25%")},
            })
    click.echo(json.dumps({"repeats": repeats, "cpus": os.cpu_count(),
                           "load_average": [round(load, 2), round(os.getloadavg()[0], 2)],
                           "models": results}, indent=1))


if __name__ == "__main__":
    main()
