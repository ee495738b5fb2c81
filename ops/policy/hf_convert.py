"""Conversion between megatron-core's GPTModel state dict and the HF Mixtral checkpoint format.

The name map is explicit and lives only here (`megatron_to_hf` / `hf_to_megatron`); the two are
exact inverses (split and concatenate, no arithmetic), so megatron -> HF -> megatron is
bit-identical. The HF side is Mixtral's on-disk format, which vLLM and transformers both load:

    embedding.word_embeddings.weight                  model.embed_tokens.weight
    decoder.layers.L.input_layernorm.weight           model.layers.L.input_layernorm.weight
    decoder.layers.L.self_attention.linear_qkv.weight model.layers.L.self_attn.{q,k,v}_proj.weight
    decoder.layers.L.self_attention.linear_proj.weight model.layers.L.self_attn.o_proj.weight
    decoder.layers.L.pre_mlp_layernorm.weight         model.layers.L.post_attention_layernorm.weight
    decoder.layers.L.mlp.router.weight                model.layers.L.block_sparse_moe.gate.weight
    ...mlp.experts.local_experts.E.linear_fc1.weight  ...block_sparse_moe.experts.E.{w1 ; w3}.weight
    ...mlp.experts.local_experts.E.linear_fc2.weight  ...block_sparse_moe.experts.E.w2.weight
    decoder.final_layernorm.weight                    model.norm.weight
    output_layer.weight                               lm_head.weight

megatron packs q, k and v per query group: for each of the G groups, (heads/G) query heads,
then one key head, then one value head, each head_dim rows. SwiGLU's fc1 is [gate ; up].
Transformer Engine's spec fuses the input norm into linear_qkv (`layer_norm_weight`); those
names are accepted as aliases of the local spec's.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ops.common.atomic import exclusive_dir
from ops.policy.model import PolicyConfig

_TE_ALIASES = {".self_attention.linear_qkv.layer_norm_weight": ".input_layernorm.weight"}


def _qkv_split(cfg: PolicyConfig, w: torch.Tensor):
    g, per = cfg.num_query_groups, cfg.num_attention_heads // cfg.num_query_groups
    w = w.view(g, per + 2, cfg.head_dim, cfg.hidden_size)
    q = w[:, :per].reshape(-1, cfg.hidden_size)
    k = w[:, per].reshape(-1, cfg.hidden_size)
    v = w[:, per + 1].reshape(-1, cfg.hidden_size)
    return q, k, v


def _qkv_join(cfg: PolicyConfig, q, k, v) -> torch.Tensor:
    g, per, hd = cfg.num_query_groups, cfg.num_attention_heads // cfg.num_query_groups, cfg.head_dim
    parts = [q.view(g, per, hd, -1), k.view(g, 1, hd, -1), v.view(g, 1, hd, -1)]
    return torch.cat(parts, dim=1).reshape(-1, cfg.hidden_size)


def megatron_to_hf(cfg: PolicyConfig, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF Mixtral tensors from a full (all experts, global indices) megatron state dict."""
    sd = {_alias(k): v for k, v in sd.items() if not k.endswith("_extra_state")}
    ffn = cfg.moe_ffn_hidden_size
    out = {
        "model.embed_tokens.weight": sd["embedding.word_embeddings.weight"],
        "model.norm.weight": sd["decoder.final_layernorm.weight"],
        "lm_head.weight": sd["output_layer.weight"],
    }
    for i in range(cfg.num_layers):
        m, h = f"decoder.layers.{i}", f"model.layers.{i}"
        q, k, v = _qkv_split(cfg, sd[f"{m}.self_attention.linear_qkv.weight"])
        out |= {
            f"{h}.input_layernorm.weight": sd[f"{m}.input_layernorm.weight"],
            f"{h}.self_attn.q_proj.weight": q,
            f"{h}.self_attn.k_proj.weight": k,
            f"{h}.self_attn.v_proj.weight": v,
            f"{h}.self_attn.o_proj.weight": sd[f"{m}.self_attention.linear_proj.weight"],
            f"{h}.post_attention_layernorm.weight": sd[f"{m}.pre_mlp_layernorm.weight"],
            f"{h}.block_sparse_moe.gate.weight": sd[f"{m}.mlp.router.weight"],
        }
        for e in range(cfg.num_experts):
            me, he = f"{m}.mlp.experts.local_experts.{e}", f"{h}.block_sparse_moe.experts.{e}"
            fc1 = sd[f"{me}.linear_fc1.weight"]
            out[f"{he}.w1.weight"], out[f"{he}.w3.weight"] = fc1[:ffn], fc1[ffn:]
            out[f"{he}.w2.weight"] = sd[f"{me}.linear_fc2.weight"]
    return {k: v.contiguous() for k, v in out.items()}


def hf_to_megatron(cfg: PolicyConfig, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of `megatron_to_hf`: a full megatron state dict (local spec names)."""
    out = {
        "embedding.word_embeddings.weight": hf["model.embed_tokens.weight"],
        "decoder.final_layernorm.weight": hf["model.norm.weight"],
        "output_layer.weight": hf["lm_head.weight"],
    }
    for i in range(cfg.num_layers):
        m, h = f"decoder.layers.{i}", f"model.layers.{i}"
        qkv = [hf[f"{h}.self_attn.{p}_proj.weight"] for p in "qkv"]
        out |= {
            f"{m}.input_layernorm.weight": hf[f"{h}.input_layernorm.weight"],
            f"{m}.self_attention.linear_qkv.weight": _qkv_join(cfg, *qkv),
            f"{m}.self_attention.linear_proj.weight": hf[f"{h}.self_attn.o_proj.weight"],
            f"{m}.pre_mlp_layernorm.weight": hf[f"{h}.post_attention_layernorm.weight"],
            f"{m}.mlp.router.weight": hf[f"{h}.block_sparse_moe.gate.weight"],
        }
        for e in range(cfg.num_experts):
            me, he = f"{m}.mlp.experts.local_experts.{e}", f"{h}.block_sparse_moe.experts.{e}"
            out[f"{me}.linear_fc1.weight"] = torch.cat([hf[f"{he}.w1.weight"], hf[f"{he}.w3.weight"]])
            out[f"{me}.linear_fc2.weight"] = hf[f"{he}.w2.weight"]
    return {k: v.contiguous() for k, v in out.items()}


def _alias(key: str) -> str:
    for te, local in _TE_ALIASES.items():
        if key.endswith(te):
            return key[: -len(te)] + local
    return key


def hf_config(cfg: PolicyConfig, tokenizer=None) -> dict:
    """Mixtral config.json for `cfg`."""
    ids = {}
    if tokenizer is not None:
        ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
               "pad_token_id": tokenizer.pad_token_id}
    return {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.moe_ffn_hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_query_groups,
        "head_dim": cfg.head_dim,
        "num_local_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.moe_router_topk,
        "router_aux_loss_coef": cfg.moe_aux_loss_coeff,
        "rms_norm_eps": cfg.layernorm_epsilon,
        "rope_theta": cfg.rotary_base,
        "max_position_embeddings": cfg.max_position_embeddings,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "sliding_window": None,
        "attention_dropout": 0.0,
        "torch_dtype": "float32",
        "perpetua_preset": cfg.name,
        **ids,
    }


def policy_config_from_hf(config: dict, name: str = "imported") -> PolicyConfig:
    """A PolicyConfig from a Mixtral config.json, to start from a published checkpoint."""
    if config.get("model_type") != "mixtral":
        raise ValueError(f"only Mixtral-format checkpoints can be imported, got model_type={config.get('model_type')!r}")
    if config.get("tie_word_embeddings"):
        raise ValueError("tied embeddings are not supported: the policy keeps input and output embeddings apart")
    return PolicyConfig(
        name=config.get("perpetua_preset", name),
        vocab_size=config["vocab_size"],
        hidden_size=config["hidden_size"],
        num_layers=config["num_hidden_layers"],
        num_attention_heads=config["num_attention_heads"],
        num_query_groups=config.get("num_key_value_heads", config["num_attention_heads"]),
        head_dim=config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"],
        moe_ffn_hidden_size=config["intermediate_size"],
        num_experts=config["num_local_experts"],
        moe_router_topk=config["num_experts_per_tok"],
        moe_aux_loss_coeff=config.get("router_aux_loss_coef", 0.01),
        rotary_base=config.get("rope_theta") or (config.get("rope_parameters") or {}).get("rope_theta", 1e6),
        layernorm_epsilon=config.get("rms_norm_eps", 1e-5),
        max_position_embeddings=config.get("max_position_embeddings", 4096),
    )


def export_hf(cfg: PolicyConfig, megatron_sd: dict[str, torch.Tensor], out_dir: Path, tokenizer=None,
              extra: dict | None = None, replace: bool = False) -> Path:
    """Write an HF Mixtral directory (config.json, model.safetensors, tokenizer files).

    Written to a `.partial` sibling, fsynced and renamed into place only if `out_dir` does not
    exist (`ops.common.atomic.exclusive_dir`), so a reader never sees a half-exported model and
    an export never replaces another writer's: that raises ArtifactConflict. `replace` swaps an
    existing export for this one (a rebuilt base policy, a scratch export).
    """
    out_dir = Path(out_dir)
    with exclusive_dir(out_dir, replace=replace) as tmp:
        write_hf(cfg, megatron_sd, tmp, tokenizer, extra)
    return out_dir


def write_hf(cfg: PolicyConfig, megatron_sd: dict[str, torch.Tensor], out_dir: Path, tokenizer=None,
             extra: dict | None = None) -> None:
    """The files of an HF Mixtral directory, written into `out_dir` as it is: a directory the
    caller has claimed and publishes (`export_hf` does both; the learner publishes its export only
    once its checkpoint is committed, ops/learn/job.py)."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    tensors = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in megatron_to_hf(cfg, megatron_sd).items()}
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(hf_config(cfg, tokenizer) | (extra or {}), indent=2))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out_dir))


def load_hf_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    """All tensors of an HF checkpoint directory (single file or sharded with an index)."""
    from safetensors.torch import load_file

    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors |= load_file(str(model_dir / f))
    return tensors


def import_hf(model_dir: Path) -> tuple[PolicyConfig, dict[str, torch.Tensor]]:
    """(PolicyConfig, megatron state dict) from an HF Mixtral directory."""
    model_dir = Path(model_dir)
    cfg = policy_config_from_hf(json.loads((model_dir / "config.json").read_text()))
    return cfg, hf_to_megatron(cfg, load_hf_tensors(model_dir))
