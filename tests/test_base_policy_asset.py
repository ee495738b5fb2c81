"""base_policy materializes in a real Dagster instance, records its success rates, and is cached."""

import dagster as dg

from assets.base_policy import base_policy


def test_base_policy_materializes_and_is_cached(perpetua_home):
    config = {"ops": {"base_policy": {"config": {"max_steps": 10, "target_success": 0.99}}}}
    with dg.instance_for_test() as instance:
        first = dg.materialize([base_policy], instance=instance, run_config=config)
        assert first.success
        mat = first.asset_materializations_for_node("base_policy")[0]
        meta = mat.metadata
        assert meta["policy_version"].value == 0
        assert set(meta["success_by_family"].value) >= {"add", "sub", "mul", "add_words", "mod"}
        assert 0.0 <= meta["bootstrap_success"].value <= 1.0
        weights = perpetua_home / "models" / "base" / "hf" / "model.safetensors"
        stamp = weights.stat().st_mtime_ns

        second = dg.materialize([base_policy], instance=instance, run_config=config)
        again = second.asset_materializations_for_node("base_policy")[0]
        assert weights.stat().st_mtime_ns == stamp  # reused, not retrained
        assert again.tags["dagster/data_version"] == mat.tags["dagster/data_version"]

        changed = {"ops": {"base_policy": {"config": {"max_steps": 11, "target_success": 0.99}}}}
        third = dg.materialize([base_policy], instance=instance, run_config=changed)
        assert third.asset_materializations_for_node("base_policy")[0].tags["dagster/data_version"] != mat.tags["dagster/data_version"]
