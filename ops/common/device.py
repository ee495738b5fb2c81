"""Whether this process has CUDA: the one switch between the GPU path and the CPU default.

torch is imported on the first call, not with this module, so that what only needs the answer
now and then (the vLLM server supervisor, `perpetua stop`, the Dagster definitions) does not pay
for torch and megatron-core at start-up.
"""

from __future__ import annotations


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()
