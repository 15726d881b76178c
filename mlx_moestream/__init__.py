"""Run Mixture-of-Experts models whose experts exceed memory: experts stream from disk under a budget."""

from .loader import load, prewarm, save_profile, save_trace, start_trace, stats

__all__ = ["load", "prewarm", "save_profile", "save_trace", "start_trace", "stats"]
