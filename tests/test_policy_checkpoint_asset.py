"""The `policy_checkpoint` asset in a real Dagster instance: it launches the learner through
Dagster Pipes under a torchrun of its own (`launcher: local`; 2 ranks, expert parallel 2), gets
one materialization back from rank 0 with the new policy version, and the per-update metrics
land in a real SQLite MLflow store. A second cycle continues from the learner's checkpoint (version 2)."""

from __future__ import annotations

import json
from pathlib import Path

import dagster as dg
import pytest


def make_base_policy(home: Path) -> Path:
    """models/base as ops.policy.bootstrap writes it (hf/ and checkpoint/), with random weights."""
    from ops.policy import checkpoint
    from ops.policy import hf_convert
    from ops.policy import tokenizer as tok_lib
    from ops.policy.model import PRESETS, build_model, init_single_process

    cfg = PRESETS["tiny"]
    base = home / "models" / "base"
    tok_lib.save_hf_tokenizer(tok_lib.train_tokenizer(cfg.vocab_size), base / "tokenizer")
    tokenizer = tok_lib.load_hf_tokenizer(base / "tokenizer")
    init_single_process()
    model = build_model(cfg, seed=7)
    sd = checkpoint.global_state_dict(model, cfg.num_experts)
    checkpoint.save(base / "checkpoint", 0, sd, meta={"policy_version": 0, "preset": cfg.name})
    return hf_convert.export_hf(cfg, sd, base / "hf", tokenizer, extra={"perpetua_policy_version": 0})


def write_cycle(home: Path, cycle: int) -> None:
    from learner_data import synthetic_tables
    from ops.common.tables import REWARDS, ROLLOUTS, write_table
    from ops.reward.scoring import rewards_path, rollouts_path

    ro, rw = synthetic_tables(4, 4, all_equal_groups=1, seed=cycle, cycle=cycle, policy_version=cycle - 1)
    write_table(ro, ROLLOUTS, rollouts_path(home / "data", cycle))
    write_table(rw, REWARDS, rewards_path(home / "data", cycle))


def step_resources(continue_from: str = "champion") -> dict:
    """The learner stage's resources for a step alone (no later on-policy iteration samples, so the
    trainer server is never started)."""
    from assets.resources import MlflowTracking, PolicyLineage, PolicyServer

    return {"pipes_subprocess_client": dg.PipesSubprocessClient(), "lineage": PolicyLineage(continue_from=continue_from),
            "trainer_server": PolicyServer(), "mlflow": MlflowTracking()}


def materialize_step(home: Path, cycle: int, continue_from: str = "latest", **config) -> tuple[dict, object]:
    """One `policy_checkpoint` materialization of `cycle` in a fresh test instance, with small
    learner settings and `config` on top: (its metadata values, the materialization)."""
    from assets.policy_checkpoint import policy_checkpoint
    from ops.common import tracking

    run_config = {"ops": {"policy_checkpoint": {"config": {
        "cycle": cycle, "micro_batch_size": 4, "updates_per_step": 2, "lr": 1e-3,
        "mlflow_tracking_uri": tracking.sqlite_uri(home / "mlflow" / "mlflow.db"), **config}}}}
    with dg.instance_for_test() as instance:
        result = dg.materialize([policy_checkpoint], instance=instance, run_config=run_config,
                                resources=step_resources(continue_from))
    assert result.success
    (mat,) = result.asset_materializations_for_node("policy_checkpoint")
    return {k: v.value for k, v in mat.metadata.items()}, mat


def test_policy_checkpoint_materializes_through_pipes(perpetua_home):
    from assets.policy_checkpoint import policy_checkpoint
    from ops.common import tracking
    from ops.policy.checkpoint import latest_complete

    make_base_policy(perpetua_home)
    write_cycle(perpetua_home, 1)
    write_cycle(perpetua_home, 2)
    uri = tracking.sqlite_uri(perpetua_home / "mlflow" / "mlflow.db")
    assert uri.startswith("sqlite:////")

    def materialize(cycle: int, continue_from: str = "latest", **config):
        # A torchrun per step; the default, the persistent learner, is tests/test_learner_service.py's.
        run_config = {"ops": {"policy_checkpoint": {"config": {
            "cycle": cycle, "micro_batch_size": 4, "updates_per_step": 2, "lr": 1e-3, "mlflow_tracking_uri": uri,
            "launcher": "local", **config}}}}
        result = dg.materialize([policy_checkpoint], instance=instance, run_config=run_config,
                                resources=step_resources(continue_from))
        assert result.success
        (mat,) = result.asset_materializations_for_node("policy_checkpoint")
        return mat, result

    with dg.instance_for_test() as instance:
        mat, result = materialize(1, nproc_per_node=2, expert_parallel=2)
        md = {k: v.value for k, v in mat.metadata.items()}
        assert md["policy_version"] == 1 and md["parent_policy_version"] == 0
        assert md["world_size"] == 2 and md["expert_parallel"] == 2 and md["updates_this_step"] == 2
        assert md["samples_kept"] == md["informative_samples"] == 12 and md["groups_filtered_all_equal"] == 1
        for key in ("loss", "pg_loss", "mismatch", "entropy", "grad_norm", "load_balancing_loss",
                    "router_balance_entropy", "tokens_per_s", "step_seconds"):
            assert isinstance(md[key], float), key
        ckpt = Path(md["checkpoint_path"])
        assert ckpt == latest_complete(perpetua_home / "models" / "learner") and ckpt.name == "step-000001"
        hf = perpetua_home / "models" / "policy" / "v0001" / "hf"
        assert Path(md["hf_dir"]) == hf
        config = json.loads((hf / "config.json").read_text())
        assert config["perpetua_policy_version"] == 1 and (hf / "tokenizer.json").exists()
        assert mat.tags.get("dagster/data_version")
        event = instance.get_latest_materialization_event(dg.AssetKey("policy_checkpoint"))
        assert event.asset_materialization.metadata["policy_version"].value == 1

        # Per optimizer update metrics in the SQLite MLflow store, in the run named in the metadata.
        client = tracking.client(uri)
        run = client.get_run(md["mlflow_run_id"])
        assert run.info.status == "FINISHED"
        assert run.data.tags[tracking.TAG_DAGSTER_RUN] == result.run_id
        for key in ("loss", "mismatch", "entropy", "grad_norm", "clip_fraction", "load_balancing_loss",
                    "router_balance_entropy", "tokens_per_s"):
            history = client.get_metric_history(run.info.run_id, key)
            assert sorted(m.step for m in history) == [1, 2], key
        assert run.data.params["learner.micro_batch_size"] == "4"

        # The next cycle resumes from the learner checkpoint: version 2, optimizer steps 3 and 4.
        mat2, _ = materialize(2)
        md2 = {k: v.value for k, v in mat2.metadata.items()}
        assert (md2["policy_version"], md2["parent_policy_version"], md2["world_size"]) == (2, 1, 1)
        assert md2["optimizer_updates"] == 4
        # It names the materialization it continued from, for the audit (ops.common.lineage.CONTINUES_FROM).
        from ops.common.lineage import CONTINUES_FROM

        assert md2[CONTINUES_FROM] == mat.tags["dagster/data_version"] and CONTINUES_FROM not in md
        assert sorted(m.step for m in client.get_metric_history(md2["mlflow_run_id"], "loss")) == [3, 4]
        assert (perpetua_home / "models" / "policy" / "v0002" / "hf" / "config.json").exists()

        # Building on the champion: nothing is deployed in this store, so the base
        # policy, v0, with fresh optimizer state; the new version is still numbered after the newest.
        mat3, _ = materialize(1, continue_from="champion")
        md3 = {k: v.value for k, v in mat3.metadata.items()}
        assert (md3["policy_version"], md3["parent_policy_version"], md3["optimizer_updates"]) == (3, 0, 2)


def test_missing_verified_batch_fails_clearly(perpetua_home):
    from assets.policy_checkpoint import policy_checkpoint

    with dg.instance_for_test() as instance:
        with pytest.raises(dg.Failure, match="no rollouts at"):
            dg.materialize([policy_checkpoint], instance=instance,
                           run_config={"ops": {"policy_checkpoint": {"config": {"cycle": 5}}}},
                           resources=step_resources())
