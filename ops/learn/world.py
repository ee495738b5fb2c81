"""The learner's process group: torchrun's world when launched by it, else one process."""

from __future__ import annotations

import os

from ops.learn.errors import LearnerError


def init_world(expert_parallel: int, seed: int) -> None:
    """torchrun's env:// world when launched by torchrun (with the collective timeout its launcher
    set, ops/learn/launch.py), else a one-process world."""
    from ops.learn.launch import COLLECTIVE_TIMEOUT_ENV
    from ops.policy.model import init_distributed, init_single_process

    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        timeout = os.environ.get(COLLECTIVE_TIMEOUT_ENV)
        init_distributed(expert_parallel, seed, float(timeout) if timeout else None)
    else:
        if expert_parallel > 1:
            raise LearnerError(f"expert_parallel={expert_parallel} needs {expert_parallel}+ ranks: "
                               f"launch with torchrun --nproc_per_node {expert_parallel}")
        import torch.distributed as dist

        if not dist.is_initialized():  # a stray MASTER_PORT (e.g. a parent's) must not be reused
            from ops.serving.supervisor import free_port

            os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(free_port())
        init_single_process(seed)


def rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_initialized() else 1


def barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
