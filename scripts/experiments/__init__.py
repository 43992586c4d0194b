"""Experiments on the toy task: run from the repository root as ``python -m scripts.experiments.<module>``."""
