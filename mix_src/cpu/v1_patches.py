"""CPU-backend patch for verl's V1 trainer (``trainer.use_v1=true``), applied by :func:`mix_src.cpu.activate`.

``patch_replay_buffer_poll``: ``ReplayBuffer.__init__`` (``verl/trainer/ppo/v1/replay_buffer.py:144``) polls
TransferQueue every ``poll_interval=2.0`` s (``_wait_for_next_poll``, 408) and the trainer passes no other value
(``verl/trainer/ppo/v1/trainer_base.py`` 154-162); a tiny CPU model finishes a batch in well under 2 s, so every
step waited for the poll (measured: scripts/bench/README.md). The default becomes :data:`CPU_POLL_INTERVAL_S`;
an explicit ``poll_interval`` wins.
"""

from __future__ import annotations

from . import replace

CPU_POLL_INTERVAL_S = 0.05
WRITTEN_FOR = {"verl": "0.9.1"}  # the line numbers above


def patch_replay_buffer_poll(mod) -> None:
    cls = mod.ReplayBuffer  # ReplayBufferAsync inherits __init__
    original = cls.__init__

    def __init__(self, *args, poll_interval: float = CPU_POLL_INTERVAL_S, **kwargs):
        original(self, *args, poll_interval=poll_interval, **kwargs)

    replace(cls, "__init__", __init__)
