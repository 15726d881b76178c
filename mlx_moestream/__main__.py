"""The `mlx-moestream` program (`python -m mlx_moestream` too)."""

import sys


def main() -> None:
    """`cli.run`, once the package imports: in a checkout whose compiled part was not built, or
    was built from another source (`policies.cyclic`), that failure is one line, not a traceback."""
    try:
        from .cli import run
    except ImportError as e:
        sys.exit(f"mlx-moestream: {e}")
    run()


if __name__ == "__main__":
    main()
