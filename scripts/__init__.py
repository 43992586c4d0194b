"""Repository scripts (not installed): run from the repository root as ``python -m scripts.<module>``."""
