"""Run Mixture-of-Experts models whose experts exceed memory: experts stream from disk under a budget."""

from .loader import load, stats

__all__ = ["load", "stats"]
