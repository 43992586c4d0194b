"""Know before you spend: per-GPU memory and GPU-hours of a run, estimated before Ray starts.

``estimate`` is pure arithmetic (units in its docstrings); ``python -m mix_src.planner`` prints the terms
(mix_src/planner/README.md)."""

from mix_src.planner.estimate import checkpoint_bytes, count_params

__all__ = ["checkpoint_bytes", "count_params"]
