"""Hydra configs of mix_src (a package so that `pkg://mix_src.config` resolves)."""
