"""The MLX backend: mlx-lm models whose expert modules compute from slot pools.

Each SwitchGLU / SwitchMLP is swapped (`attach`) for a module that streams its experts into
pools shared by the layers of one expert shape (`streaming`), or, when every expert has a slot,
keeps them resident (`resident`); `hosts` divides the experts among the hosts of a
distributed load, and `loading` builds the model and runs the shared load pipeline.
"""

from .hosts import host_stats
from .loading import load, load_lazy, run_text

__all__ = ["host_stats", "load", "load_lazy", "run_text"]
