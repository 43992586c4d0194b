"""Run verl 0.9.1's own SFT trainer (``verl.trainer.sft_trainer``) on the CPU backend.

Launch exactly like the stock module, under torchrun::

    VERL_PLATFORM=cpu python -m torch.distributed.run --standalone --nproc_per_node=1 \\
        scripts/experiments/sft_cpu.py [--config-path DIR --config-name NAME] key=value ...

The only difference from ``python -m verl.trainer.sft_trainer``: ``verl.utils.distributed.
initialize_global_process_group`` builds the backend string ``"cpu:gloo,{device}:{nccl-backend}"``, which on
the cpu platform is ``"cpu:gloo,cpu:gloo"`` and torch rejects it ("Duplicate device type cpu"). mix_src.cpu
patches the Ray variant of that function only, so this launcher makes the torchrun variant use plain
"gloo" and otherwise calls verl's ``main`` unchanged.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed

import verl.utils.distributed as vdist


def initialize_global_process_group(timeout_second=36000):
    torch.distributed.init_process_group(
        backend="gloo", timeout=timedelta(seconds=timeout_second), init_method=os.environ.get("DIST_INIT_METHOD")
    )
    return int(os.environ["LOCAL_RANK"]), int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


vdist.initialize_global_process_group = initialize_global_process_group

if __name__ == "__main__":
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    from verl.trainer.sft_trainer import main

    main()
