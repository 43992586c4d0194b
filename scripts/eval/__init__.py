"""Run from the repository root: ``python -m scripts.eval.<module> ...``."""
