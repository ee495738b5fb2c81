"""The policy: a Mixtral-shaped MoE decoder built on megatron-core's GPTModel.

RoPE, RMSNorm, SwiGLU experts, a top-k softmax router with a load-balancing loss, untied
embeddings. `PolicyConfig` is the one description of the architecture: megatron's
TransformerConfig and the HF MixtralConfig are both derived from it, so the three engines
(megatron-core, transformers, vLLM) cannot disagree about shapes.
"""

from __future__ import annotations

import os
from typing import Annotated, Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, Field

from ops.policy import megatron_cpu


class PolicyConfig(BaseModel):
    """Architecture of the MoE policy. Every field maps onto Mixtral's config.json."""

    model_config = {"frozen": True}

    name: Annotated[str, Field(description="Preset name, recorded with every checkpoint")]
    vocab_size: Annotated[int, Field(gt=0, description="Tokenizer vocabulary size")]
    hidden_size: Annotated[int, Field(gt=0, description="Model width")]
    num_layers: Annotated[int, Field(gt=0, description="Decoder layers")]
    num_attention_heads: Annotated[int, Field(gt=0, description="Query heads")]
    num_query_groups: Annotated[int, Field(gt=0, description="Key/value heads (GQA groups)")]
    head_dim: Annotated[int, Field(gt=0, description="Per-head width; vLLM's CPU kernels need 64+")]
    moe_ffn_hidden_size: Annotated[int, Field(gt=0, description="Hidden size of each SwiGLU expert")]
    num_experts: Annotated[int, Field(gt=0, description="Experts per MoE layer")]
    moe_router_topk: Annotated[int, Field(gt=0, description="Experts each token is routed to")]
    moe_aux_loss_coeff: Annotated[float, Field(ge=0, description="Load-balancing loss weight")] = 0.01
    rotary_base: Annotated[float, Field(gt=0, description="RoPE theta")] = 1_000_000.0
    layernorm_epsilon: Annotated[float, Field(gt=0, description="RMSNorm epsilon")] = 1e-5
    max_position_embeddings: Annotated[int, Field(gt=0, description="Longest sequence")] = 256

    @property
    def num_parameters(self) -> int:
        h, kv = self.hidden_size, self.num_query_groups * self.head_dim
        q = self.num_attention_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h
        moe = self.num_experts * 3 * h * self.moe_ffn_hidden_size + self.num_experts * h
        return self.num_layers * (attn + moe + 2 * h) + 2 * self.vocab_size * h + h


PRESETS: dict[str, PolicyConfig] = {
    # The embedded default: a few million parameters, trains and serves on 2 CPU cores.
    "tiny": PolicyConfig(
        name="tiny", vocab_size=512, hidden_size=256, num_layers=2, num_attention_heads=4,
        num_query_groups=2, head_dim=64, moe_ffn_hidden_size=512, num_experts=4, moe_router_topk=2,
    ),
    # Real shapes, for clusters (configs only; not run here).
    "mixtral-8x7b": PolicyConfig(
        name="mixtral-8x7b", vocab_size=32000, hidden_size=4096, num_layers=32, num_attention_heads=32,
        num_query_groups=8, head_dim=128, moe_ffn_hidden_size=14336, num_experts=8, moe_router_topk=2,
        max_position_embeddings=32768, rotary_base=1_000_000.0,
    ),
    "qwen3-30b-a3b": PolicyConfig(
        name="qwen3-30b-a3b", vocab_size=151936, hidden_size=2048, num_layers=48, num_attention_heads=32,
        num_query_groups=4, head_dim=128, moe_ffn_hidden_size=768, num_experts=128, moe_router_topk=8,
        max_position_embeddings=40960, layernorm_epsilon=1e-6, moe_aux_loss_coeff=0.001,
    ),
}


Precision = Literal["fp32", "bf16"]


def transformer_config(cfg: PolicyConfig, precision: Precision = "fp32", expert_parallel: int = 1):
    from megatron.core.transformer.transformer_config import TransformerConfig

    bf16 = precision == "bf16"
    return TransformerConfig(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_query_groups,
        kv_channels=cfg.head_dim,
        ffn_hidden_size=cfg.moe_ffn_hidden_size,
        moe_ffn_hidden_size=cfg.moe_ffn_hidden_size,
        num_moe_experts=cfg.num_experts,
        moe_router_topk=cfg.moe_router_topk,
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=cfg.moe_aux_loss_coeff,
        moe_token_dispatcher_type="allgather",  # "alltoall" fails on gloo (docs/engines.md)
        moe_router_dtype="fp32",
        expert_model_parallel_size=expert_parallel,
        gated_linear_unit=True,
        activation_func=F.silu,
        normalization="RMSNorm",
        layernorm_epsilon=cfg.layernorm_epsilon,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        use_cpu_initialization=not megatron_cpu.cuda_available(),
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
    )


def layer_spec(cfg: PolicyConfig):
    """Transformer Engine's spec on CUDA when installed, megatron's local spec otherwise."""
    from megatron.core.models.gpt import gpt_layer_specs as specs

    if megatron_cpu.cuda_available():
        try:
            import transformer_engine  # noqa: F401

            return specs.get_gpt_layer_with_transformer_engine_spec(num_experts=cfg.num_experts)
        except ImportError:
            return specs.get_gpt_layer_local_spec(num_experts=cfg.num_experts, normalization="RMSNorm")
    spec = specs.get_gpt_layer_local_spec(num_experts=cfg.num_experts, normalization="RMSNorm")
    return megatron_cpu.cpu_layer_spec(spec)


def init_single_process(seed: int = 0) -> None:
    """A one-process model-parallel world (gloo on CPU, NCCL on GPU), as megatron requires."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from ops.serving.supervisor import free_port

    megatron_cpu.apply()
    if not dist.is_initialized():
        # An explicit address, not MASTER_ADDR/MASTER_PORT: those would be inherited by child
        # processes (a `perpetua parity` run from a test) and collide with this store's port.
        backend = "nccl" if megatron_cpu.cuda_available() else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel()
    seed_everything(seed)


def init_distributed(expert_parallel: int = 1, seed: int = 0, timeout_s: float | None = None) -> None:
    """The torchrun world: the env:// rendezvous, expert parallelism of `expert_parallel` ranks.
    `timeout_s`: how long one collective waits for its peers before it fails (None: torch's default)."""
    import datetime

    import torch.distributed as dist
    from megatron.core import parallel_state

    megatron_cpu.apply()
    if not dist.is_initialized():
        backend = "nccl" if megatron_cpu.cuda_available() else "gloo"
        timeout = {"timeout": datetime.timedelta(seconds=timeout_s)} if timeout_s else {}
        dist.init_process_group(backend, **timeout)
        if megatron_cpu.cuda_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(expert_model_parallel_size=expert_parallel)
    seed_everything(seed)


def seed_everything(seed: int) -> None:
    """Seed torch, and on CUDA megatron's model-parallel RNG tracker too: megatron initialises
    weights and dropout on the GPU under that tracker's named states, which must exist first."""
    torch.manual_seed(seed)
    if megatron_cpu.cuda_available():
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(seed)


def build_model(cfg: PolicyConfig, precision: Precision = "fp32", expert_parallel: int = 1, seed: int = 0):
    """A megatron GPTModel for `cfg`. The model-parallel world must be initialised first."""
    from megatron.core.models.gpt import GPTModel

    megatron_cpu.apply()
    seed_everything(seed)
    model = GPTModel(
        config=transformer_config(cfg, precision, expert_parallel),
        transformer_layer_spec=layer_spec(cfg),
        vocab_size=cfg.vocab_size,
        max_sequence_length=cfg.max_position_embeddings,
        position_embedding_type="rope",
        rotary_base=int(cfg.rotary_base),
        share_embeddings_and_output_weights=False,
    )
    if megatron_cpu.cuda_available():
        model = model.cuda()
    return model


def forward_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    """Logits [batch, seq, vocab] for right-padded token ids [batch, seq]."""
    positions = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand_as(tokens)
    return model(tokens, positions, attention_mask=None)


def token_logprobs(model, tokens: torch.Tensor) -> torch.Tensor:
    """log p(tokens[:, t] | tokens[:, :t]) for t >= 1, shape [batch, seq - 1], in float32."""
    return logprobs_from_logits(forward_logits(model, tokens), tokens)


def tempered(logits: torch.Tensor, temperature: torch.Tensor | None) -> torch.Tensor:
    """Logits [b, T, V] in float32, divided by each row's sampling temperature [b] when given.

    Rollouts record vLLM's processed log-probs (logprobs_mode=processed_logprobs,
    ops/rollout/vllm_engine.py): those of the distribution actually sampled, softmax(logits / T).
    The learner scores the same distribution, so the importance ratio of on-policy data is 1 at
    any temperature."""
    logits = logits.float()
    if temperature is None:
        return logits
    return logits / temperature.to(logits.device, logits.dtype).view(-1, 1, 1)


def logprobs_from_logits(logits: torch.Tensor, tokens: torch.Tensor, temperature: torch.Tensor | None = None) -> torch.Tensor:
    """log p(tokens[:, t+1] | tokens[:, :t+1]) from logits [b, T, V] -> [b, T-1], float32, at each
    row's temperature (None: the model's own distribution)."""
    logp = torch.log_softmax(tempered(logits[:, :-1], temperature), dim=-1)
    return logp.gather(-1, tokens[:, 1:].unsqueeze(-1)).squeeze(-1)
