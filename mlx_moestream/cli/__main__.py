"""`python -m mlx_moestream.cli`: the program `mlx-moestream`."""

from . import run

if __name__ == "__main__":
    run()
