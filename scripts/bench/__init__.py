"""Benchmarks: ``python -m scripts.bench {core,rewards,step,all}``.

Each benchmark prints ratios against a baseline measured in the same run (no absolute timing targets in
tests)."""
