import pytest
import torch

from ops.policy import checkpoint
from ops.policy.model import PRESETS, build_model, init_single_process, token_logprobs


def test_save_load_model_optimizer_rng_and_ignore_partials(tmp_path):
    init_single_process()
    cfg = PRESETS["tiny"]
    model = build_model(cfg, seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, cfg.vocab_size, (2, 10))
    (-token_logprobs(model, tokens).mean()).backward()
    opt.step()
    names = checkpoint.param_names(model, cfg.num_experts)
    torch.manual_seed(99)
    path = checkpoint.save(tmp_path, 1, checkpoint.global_state_dict(model, cfg.num_experts),
                           checkpoint.optimizer_state(opt, names), meta={"policy_version": 1})
    expected_next_random = torch.rand(3)
    (tmp_path / "step-000002.partial").mkdir()  # a save killed half-way
    assert checkpoint.latest_complete(tmp_path) == path
    assert checkpoint.meta(path)["policy_version"] == 1

    other = build_model(cfg, seed=2)
    other_opt = torch.optim.AdamW(other.parameters(), lr=1e-3)
    other_names = checkpoint.param_names(other, cfg.num_experts)
    template_opt = checkpoint.optimizer_state(opt, names)  # same shapes
    state = checkpoint.load(path, checkpoint.global_state_dict(other, cfg.num_experts), template_opt)
    checkpoint.load_optimizer_state(other_opt, other_names, state["optim"])
    torch.set_rng_state(state["rng"]["rank0"])
    assert torch.equal(torch.rand(3), expected_next_random)
    for (k, a), b in zip(model.state_dict().items(), other.state_dict().values()):
        if not k.endswith("_extra_state"):
            assert torch.equal(a, b), k
    p_model = next(iter(model.parameters()))
    p_other = next(iter(other.parameters()))
    assert torch.equal(opt.state[p_model]["exp_avg"], other_opt.state[p_other]["exp_avg"])
    full = checkpoint.load_model_tensors(path)
    assert torch.equal(full["output_layer.weight"], model.state_dict()["output_layer.weight"])


def _tiny_state():
    init_single_process()
    cfg = PRESETS["tiny"]
    return checkpoint.global_state_dict(build_model(cfg, seed=1), cfg.num_experts)


def test_a_saved_step_is_never_overwritten(tmp_path):
    from ops.common.atomic import ArtifactConflict

    sd = _tiny_state()
    first = checkpoint.save(tmp_path, 3, sd, meta={"writer": "first"})
    files = {p.name: p.read_bytes() for p in first.iterdir()}
    with pytest.raises(ArtifactConflict, match="exists already"):
        checkpoint.save(tmp_path, 3, sd, meta={"writer": "second"})
    assert {p.name: p.read_bytes() for p in first.iterdir()} == files
    assert checkpoint.meta(first)["writer"] == "first"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000003"]


def test_two_writers_racing_for_one_step(tmp_path):
    """The second writer arrives while the first is between its tensors and its COMPLETE marker:
    it is refused, and the first one's checkpoint is published whole."""
    from ops.common.atomic import ArtifactConflict

    sd = _tiny_state()
    refused = []

    def second_writer():
        with pytest.raises(ArtifactConflict, match="another writer") as e:
            checkpoint.save(tmp_path, 4, sd, meta={"writer": "second"})
        refused.append(str(e.value))

    path = checkpoint.save(tmp_path, 4, sd, meta={"writer": "first"}, before_commit=second_writer)
    assert refused and checkpoint.meta(path)["writer"] == "first" and (path / checkpoint.COMPLETE).exists()
    assert checkpoint.latest_complete(tmp_path) == path
    assert torch.equal(checkpoint.load_model_tensors(path)["output_layer.weight"], sd["output_layer.weight"])


def test_a_dead_writers_partial_step_is_cleared_by_the_next(tmp_path):
    sd = _tiny_state()
    stale = tmp_path / "step-000005.partial"
    stale.mkdir()
    (stale / "junk").write_text("half a save")
    path = checkpoint.save(tmp_path, 5, sd, meta={"writer": "next"})
    assert not stale.exists() and not (path / "junk").exists() and checkpoint.meta(path)["writer"] == "next"
