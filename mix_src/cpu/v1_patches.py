"""CPU-backend patches for verl's V1 trainer (``trainer.use_v1=true``), applied by :func:`mix_src.cpu.activate`.

``patch_replay_buffer_poll`` — ``verl/trainer/ppo/v1/replay_buffer.py:144``: ``ReplayBuffer.__init__`` polls
TransferQueue every ``poll_interval=2.0`` s while it waits for finished rollouts (``_wait_for_next_poll``, 408),
and the trainer never passes another value (``verl/trainer/ppo/v1/trainer_base.py`` 154-162), so no config key
can change it. A tiny CPU model finishes a batch in well under 2 s, so every sync step waited for the next poll
(measured on cpu_tiny: ``timing_s/gen`` 2.01-2.36 s in every step). On the CPU backend the default becomes
:data:`CPU_POLL_INTERVAL_S`; one poll is one ``tq.kv_list`` call. An explicit ``poll_interval`` still wins.
"""

from __future__ import annotations

CPU_POLL_INTERVAL_S = 0.05
WRITTEN_FOR = {"verl": "0.9.1"}  # the line numbers above


def patch_replay_buffer_poll(mod) -> None:
    cls = mod.ReplayBuffer  # ReplayBufferAsync inherits __init__
    original = cls.__init__
    if getattr(original, "_mix_src_cpu", False):
        return

    def __init__(self, *args, poll_interval: float = CPU_POLL_INTERVAL_S, **kwargs):
        original(self, *args, poll_interval=poll_interval, **kwargs)

    __init__._mix_src_cpu = True
    __init__.__doc__ = original.__doc__
    cls.__init__ = __init__
