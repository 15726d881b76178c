"""Run Mixture-of-Experts models whose experts exceed memory: experts stream from disk under a budget."""

from .loader import (load, prewarm, profile, run_text, save_profile, save_trace, start_trace,
                     stats)

__all__ = ["load", "prewarm", "profile", "run_text", "save_profile", "save_trace", "start_trace",
           "stats"]
