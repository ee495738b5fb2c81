import pytest
import torch

from ops.policy import megatron_cpu
from ops.policy.model import PRESETS, PolicyConfig, build_model, init_single_process, token_logprobs


def test_presets_have_the_published_sizes():
    assert 2e6 < PRESETS["tiny"].num_parameters < 5e6 and PRESETS["tiny"].head_dim == 64
    # Mixtral-8x7B: 46.7B parameters; Qwen3-30B-A3B: 30.5B (without its q/k norms, ~0.01%).
    assert PRESETS["mixtral-8x7b"].num_parameters == pytest.approx(46.7e9, rel=0.01)
    assert PRESETS["qwen3-30b-a3b"].num_parameters == pytest.approx(30.5e9, rel=0.01)


def test_tiny_moe_trains_on_cpu():
    init_single_process()
    cfg = PRESETS["tiny"]
    model = build_model(cfg, seed=0)
    assert sum(p.numel() for p in model.parameters()) == cfg.num_parameters
    tokens = torch.randint(0, cfg.vocab_size, (2, 16))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = token_logprobs(model, tokens).mean()
    (-before).backward()
    assert model.decoder.layers[0].mlp.router.weight.grad.abs().sum() > 0  # routed, not bypassed
    opt.step()
    with torch.no_grad():
        assert token_logprobs(model, tokens).mean() > before


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU adaptations are inactive on CUDA")
def test_cpu_adaptations_are_applied_in_one_place():
    assert megatron_cpu.apply() is True
    assert torch.cuda.current_device() == torch.device("cpu")
    from megatron.core.transformer.moe import moe_utils

    assert moe_utils.te_general_gemm is None


def test_cpu_adaptations_are_inactive_on_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert megatron_cpu.apply() is False


def test_sdpa_core_attention_matches_reference_gqa():
    cfg = PolicyConfig(name="t", vocab_size=8, hidden_size=16, num_layers=1, num_attention_heads=4,
                       num_query_groups=2, head_dim=4, moe_ffn_hidden_size=8, num_experts=2, moe_router_topk=2)
    from ops.policy.model import transformer_config

    attn = megatron_cpu.SDPACoreAttention(transformer_config(cfg), 1, None, None)
    s, b = 5, 2
    q, k, v = torch.randn(s, b, 4, 4), torch.randn(s, b, 2, 4), torch.randn(s, b, 2, 4)
    out = attn(q, k, v)
    # reference: explicit softmax(QK^T/sqrt(d) + causal) V with each kv head shared by 2 q heads
    kk, vv = k.repeat_interleave(2, dim=2), v.repeat_interleave(2, dim=2)
    scores = torch.einsum("sbhd,tbhd->bhst", q, kk) / 2.0
    scores = scores.masked_fill(torch.triu(torch.ones(s, s, dtype=torch.bool), 1), float("-inf"))
    ref = torch.einsum("bhst,tbhd->sbhd", scores.softmax(-1), vv).reshape(s, b, 16)
    assert torch.allclose(out, ref, atol=1e-6)
