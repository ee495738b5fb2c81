"""base_policy materializes in a real Dagster instance, records its success rates, and is cached;
a copy of it in another home is reused under the config it records (what `perpetua bench
cycle|learning --base` rely on), and a base the bootstrap would not reuse is refused up front."""

import json
import shutil

import dagster as dg
import pytest

from assets.base_policy import CONFIG_FILE, base_policy, reuse_run_config
from ops.envs import get_environment


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


def test_a_copied_base_is_reused_under_its_recorded_config(perpetua_home, tmp_path, monkeypatch):
    config = {"ops": {"base_policy": {"config": {"max_steps": 10, "target_success": 0.99}}}}
    with dg.instance_for_test() as instance:
        first = dg.materialize([base_policy], instance=instance, run_config=config)
    base = perpetua_home / "models" / "base"
    assert json.loads((base / CONFIG_FILE).read_text())["max_steps"] == 10
    reuse = reuse_run_config(base, get_environment())
    assert reuse["ops"]["base_policy"]["config"]["max_steps"] == 10

    other = tmp_path / "other-home"
    shutil.copytree(base, other / "models" / "base")
    monkeypatch.setenv("PERPETUA_HOME", str(other))
    weights = other / "models" / "base" / "hf" / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    with dg.instance_for_test() as instance:
        again = dg.materialize([base_policy], instance=instance, run_config=reuse)
    assert weights.stat().st_mtime_ns == stamp  # reused, not retrained
    data_version = "dagster/data_version"
    assert (again.asset_materializations_for_node("base_policy")[0].tags[data_version]
            == first.asset_materializations_for_node("base_policy")[0].tags[data_version])

    # without the recorded config the copy would be retrained under the defaults: refused
    (other / "models" / "base" / CONFIG_FILE).unlink()
    with pytest.raises(ValueError, match="trained under another base_policy config"):
        reuse_run_config(other / "models" / "base", get_environment())
    with pytest.raises(ValueError, match="not a finished base policy"):
        reuse_run_config(tmp_path / "nothing", get_environment())
