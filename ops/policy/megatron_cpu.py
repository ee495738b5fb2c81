"""Everything megatron-core needs to run without CUDA (or without Transformer Engine), in one place.

megatron-core targets GPUs with Transformer Engine. Three adaptations let the same model code run
on a CPU-only torch (docs/engines.md); 1 and 3 are applied only when CUDA is absent, so the CUDA
path stays stock:

1. `torch.cuda.current_device()` is called to place router weights, RoPE buffers and expert
   weights; on CPU torch it raises. It returns the CPU device instead.
2. `moe_utils` refers to `te_general_gemm` without Transformer Engine (NameError in the router
   gating linear of 0.16.1, on CPU and on CUDA alike); it is defined as None so the plain matmul
   path is taken. This one applies whenever Transformer Engine is not installed.
3. The local spec's `DotProductAttention` needs the CUDA RNG tracker and memory buffers; the
   layer spec's `core_attention` is swapped for `SDPACoreAttention` (`cpu_layer_spec`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule

from ops.common.device import cuda_available

_applied = False


def apply() -> bool:
    """Apply the adaptations once; returns whether the CPU ones are active (False on CUDA)."""
    global _applied
    if not _applied:
        from megatron.core.transformer.moe import moe_utils

        if not hasattr(moe_utils, "te_general_gemm"):  # Transformer Engine absent (2)
            moe_utils.te_general_gemm = None
        if not cuda_available():
            torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment]
        _applied = True
    return not cuda_available()


class SDPACoreAttention(MegatronModule):
    """Causal attention through torch's scaled_dot_product_attention.

    Same contract as megatron's DotProductAttention: query [sq, b, np, hn], key/value
    [sk, b, ng, hn] -> context [sq, b, np * hn]. The mask argument is ignored: sequences are
    right-padded, so a causal mask alone keeps every real token's attention exact.
    """

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, **_):
        super().__init__(config=config)
        self.softmax_scale = softmax_scale

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, hn]
        if k.shape[1] != q.shape[1]:  # grouped-query attention
            repeat = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        ctx = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale)
        sq, b = query.shape[0], query.shape[1]
        return ctx.permute(2, 0, 1, 3).reshape(sq, b, -1)


def cpu_layer_spec(spec):
    """The local layer spec with its core attention replaced by SDPACoreAttention."""
    spec.submodules.self_attention.submodules.core_attention = SDPACoreAttention
    return spec
