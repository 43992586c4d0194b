"""Pure maths of the algorithm: torch/numpy only (no verl, Ray or vLLM imports), with shape docstrings."""
