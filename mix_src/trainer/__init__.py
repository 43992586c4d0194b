"""The two trainer bases' shared pieces: per-step stages and the state both keep across steps."""
