import json
from pathlib import Path

import pytest
import torch

from ops.policy import checkpoint

from ops.policy import hf_convert

from ops.policy import tokenizer as tok_lib
from ops.policy.model import PRESETS, PolicyConfig, build_model, init_single_process, token_logprobs

GQA = PolicyConfig(name="gqa", vocab_size=512, hidden_size=256, num_layers=2, num_attention_heads=4,
                   num_query_groups=2, head_dim=64, moe_ffn_hidden_size=128, num_experts=4, moe_router_topk=2)


@pytest.mark.parametrize("cfg", [PRESETS["tiny"], GQA], ids=["tiny", "gqa-2-groups"])
def test_megatron_hf_megatron_is_bit_identical(cfg):
    init_single_process()
    sd = checkpoint.global_state_dict(build_model(cfg, seed=3), cfg.num_experts)
    back = hf_convert.hf_to_megatron(cfg, hf_convert.megatron_to_hf(cfg, sd))
    assert back.keys() == sd.keys()
    assert all(torch.equal(back[k], sd[k]) for k in sd)


def test_export_loads_in_transformers_with_same_logprobs(tmp_path):
    from transformers import MixtralForCausalLM

    init_single_process()
    cfg = GQA
    model = build_model(cfg, seed=5).eval()
    tok_lib.save_hf_tokenizer(tok_lib.train_tokenizer(cfg.vocab_size), tmp_path / "tok")
    tokenizer = tok_lib.load_hf_tokenizer(tmp_path / "tok")
    out = hf_convert.export_hf(cfg, checkpoint.global_state_dict(model, cfg.num_experts), tmp_path / "hf", tokenizer)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    assert not (tmp_path / "hf.partial").exists()
    hf = MixtralForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    ids = torch.tensor([tokenizer.encode("Q: What is 3 + 4?\nCALL calc(3+4)\n")])
    with torch.no_grad():
        a = token_logprobs(model, ids)
        b = torch.log_softmax(hf(ids).logits[0, :-1], -1).gather(-1, ids[0, 1:, None]).squeeze(-1)
    assert (a - b).abs().max() < 1e-4


def test_import_a_checkpoint_written_by_transformers(tmp_path):
    """A published Mixtral checkpoint (here: one transformers writes itself) imports into megatron."""
    from transformers import MixtralConfig, MixtralForCausalLM

    hf_cfg = MixtralConfig(vocab_size=96, hidden_size=128, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=64, num_local_experts=4,
                           num_experts_per_tok=2, rope_theta=10000.0)
    torch.manual_seed(0)
    hf = MixtralForCausalLM(hf_cfg).eval()
    hf.save_pretrained(str(tmp_path))
    cfg, sd = hf_convert.import_hf(tmp_path)
    assert cfg.rotary_base == 10000.0 and cfg.num_experts == 4
    init_single_process()
    model = build_model(cfg)
    checkpoint.load_global_state_dict(model, sd, cfg.num_experts)
    model.eval()
    ids = torch.randint(0, 96, (1, 12))
    with torch.no_grad():
        a = token_logprobs(model, ids)
        b = torch.log_softmax(hf(ids).logits[0, :-1], -1).gather(-1, ids[0, 1:, None]).squeeze(-1)
    assert (a - b).abs().max() < 1e-4


def test_import_rejects_other_architectures(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="only Mixtral-format"):
        hf_convert.import_hf(tmp_path)


class _SlowTokenizer:
    """Tokenizer files written while another writer tries the same export."""
    bos_token_id, eos_token_id, pad_token_id = 1, 2, 0

    def __init__(self, during):
        self.during = during

    def save_pretrained(self, out_dir: str) -> None:
        (Path(out_dir) / "tokenizer.json").write_text("{}")
        self.during()


def test_two_writers_racing_for_one_policy_version(tmp_path):
    """One wins, the other gets a clear error, the winner's files are intact."""
    from ops.common.atomic import ArtifactConflict

    init_single_process()
    cfg = PRESETS["tiny"]
    sd_a = checkpoint.global_state_dict(build_model(cfg, seed=1), cfg.num_experts)
    sd_b = checkpoint.global_state_dict(build_model(cfg, seed=2), cfg.num_experts)
    target = tmp_path / "v0001" / "hf"
    refused = []

    def second_writer():
        with pytest.raises(ArtifactConflict, match="another writer is writing it now") as e:
            hf_convert.export_hf(cfg, sd_b, target, extra={"writer": "b"})
        refused.append(str(e.value))

    hf_convert.export_hf(cfg, sd_a, target, _SlowTokenizer(second_writer), extra={"writer": "a"})
    assert refused
    files = {p.name: p.read_bytes() for p in target.iterdir()}
    with pytest.raises(ArtifactConflict, match="exists already"):
        hf_convert.export_hf(cfg, sd_b, target, extra={"writer": "b"})
    assert {p.name: p.read_bytes() for p in target.iterdir()} == files
    assert json.loads((target / "config.json").read_text())["writer"] == "a"
    back = hf_convert.hf_to_megatron(cfg, hf_convert.load_hf_tensors(target))
    assert torch.equal(back["output_layer.weight"], sd_a["output_layer.weight"])
    assert sorted(p.name for p in target.parent.iterdir()) == ["hf"]


def test_replace_swaps_an_export(tmp_path):
    init_single_process()
    cfg = PRESETS["tiny"]
    sd = checkpoint.global_state_dict(build_model(cfg, seed=1), cfg.num_experts)
    hf_convert.export_hf(cfg, sd, tmp_path / "hf", extra={"writer": "a"})
    hf_convert.export_hf(cfg, sd, tmp_path / "hf", extra={"writer": "b"}, replace=True)
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["writer"] == "b"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]
