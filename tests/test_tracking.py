"""MLflow as the record of a cycle, against a real SQLite store (and one real `mlflow server`)."""

from __future__ import annotations

import json
import socket

import pytest

from ops.cost.accounting import Campaign, CycleRecord, cycle_cost
from ops.cost.meter import StageCost
from ops.cost.prices import PriceTable
from ops.cost.plot import ipd_figure
from ops.common.paths import Home
from ops.common.tables import REWARDS, table_hash, write_table
from ops.common.tracking import (
    TAG_PARENT,
    RunLog,
    TrackingError,
    check_tracking_uri,
    client,
    dagster_tags,
    existing_tracking_uri,
    load_campaign,
    local_store,
    log_cycle_metrics,
    run_url,
    stage_run,
    start_cycle_run,
    end_run,
    tracking_uri,
)

EXPERIMENT = "perpetua-test"


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("mlflow")
    uri, _ = local_store(root)
    return uri, root


def rewards_table(path):
    rows = [
        {"group_id": "g1", "sample_index": i, "task_id": "t1", "verifier": "calc", "verifier_version": "1",
         "reward": float(i % 2), "outcome": "pass" if i % 2 else "fail", "details": "{}", "flagged": False,
         "seconds": 0.01}
        for i in range(4)
    ]  # fmt: skip
    return write_table(rows, REWARDS, path)


def test_tracking_uri_must_be_absolute():
    with pytest.raises(TrackingError, match="relative sqlite"):
        check_tracking_uri("sqlite:///mlflow.db")
    with pytest.raises(TrackingError, match="unsupported"):
        check_tracking_uri("./mlruns")
    assert check_tracking_uri("http://127.0.0.1:5000") == "http://127.0.0.1:5000"


def test_one_rule_resolves_the_tracking_uri(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PERPETUA_HOME", "relative-home")  # resolved against the cwd, made absolute
    h = Home((tmp_path / "relative-home").resolve())
    local = f"sqlite:///{h.mlflow / 'mlflow.db'}"
    assert local.startswith("sqlite:////")
    # No setting, no server: the SQLite store under PERPETUA_HOME; readers find nothing there yet.
    assert tracking_uri() == tracking_uri(None, h) == local
    assert existing_tracking_uri() is None
    h.mlflow.mkdir(parents=True)
    (h.mlflow / "mlflow.db").touch()
    assert existing_tracking_uri() == local
    # The environment, then an explicit setting, take precedence; every answer is checked.
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5999")
    assert tracking_uri() == existing_tracking_uri() == "http://127.0.0.1:5999"
    assert tracking_uri("sqlite:////elsewhere/mlflow.db") == "sqlite:////elsewhere/mlflow.db"
    with pytest.raises(TrackingError, match="relative sqlite"):
        tracking_uri("sqlite:///mlflow.db")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///mlflow.db")  # MLflow's own default: never used
    with pytest.raises(TrackingError, match="relative sqlite"):
        tracking_uri()
    with pytest.raises(TrackingError, match="relative sqlite"):
        client()
    with pytest.raises(TrackingError, match="empty"):
        client("")
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    assert client() is client(local)  # one factory: uri None resolves, clients are shared per store
    assert not list(tmp_path.glob("mlflow.db")) and not (tmp_path / "mlruns").exists()


def test_a_recorded_cycle_reads_back(store, tmp_path):
    uri, root = store
    c = client(uri)
    parent = start_cycle_run(
        uri, EXPERIMENT, cycle=1, tags=dagster_tags("dg-run-1", partition="1"), params={"policy_version_in": 0}
    )
    table = rewards_table(tmp_path / "rewards.parquet")
    digest = table_hash(table)
    with stage_run(uri, parent, "verified_rewards", tags=dagster_tags("dg-run-1", "verified_rewards", "1")) as log:
        log.log_params({"config": {"timeout_s": 5, "families": ["add", "mod"]}, "verifier_versions": {"calc": "1"}})
        log.log_metrics({"mean_reward": 0.5})
        assert log.log_dataset(table.to_pandas(), tmp_path / "rewards.parquet", "rewards", "verified_rewards", digest) == digest
    model_dir = tmp_path / "hf"
    model_dir.mkdir()
    (model_dir / "config.json").write_text('{"model_type": "mixtral"}')
    with stage_run(uri, parent, "policy_checkpoint", params={"policy_version_in": 0, "policy_version_out": 1}) as log:
        model_id = log.log_checkpoint(
            "policy-v1", step=1, model_dir=model_dir, params={"lr": 1e-5}, metrics={"loss": 0.25, "kl": 0.01}
        )
    with pytest.raises(ValueError, match="learner crashed"):
        with stage_run(uri, parent, "eval_report"):
            raise ValueError("learner crashed")
    end_run(uri, parent)

    run = c.get_run(parent)
    assert run.info.status == "FINISHED"
    assert run.data.tags["dagster.run_id"] == "dg-run-1" and run.data.tags["perpetua.cycle"] == "1"
    assert run.data.params["policy_version_in"] == "0"
    children = c.search_runs([run.info.experiment_id], filter_string=f"tags.`{TAG_PARENT}` = '{parent}'")
    by_stage = {r.data.tags["perpetua.stage"]: r for r in children}
    assert set(by_stage) == {"verified_rewards", "policy_checkpoint", "eval_report"}
    assert by_stage["eval_report"].info.status == "FAILED"
    rewards = by_stage["verified_rewards"]
    assert rewards.info.status == "FINISHED"
    assert rewards.data.tags["dagster.asset_key"] == "verified_rewards" and rewards.data.tags["perpetua.cycle"] == "1"
    assert rewards.data.params["config.timeout_s"] == "5"
    assert rewards.data.params["config.families"] == '["add", "mod"]'
    assert rewards.data.metrics["mean_reward"] == 0.5
    (ds,) = rewards.inputs.dataset_inputs
    assert (ds.dataset.name, ds.dataset.digest) == ("rewards", digest)
    assert str(tmp_path / "rewards.parquet") in ds.dataset.source
    assert {t.key: t.value for t in ds.tags}["mlflow.data.context"] == "verified_rewards"
    # The checkpoint: a READY LoggedModel with its params, metrics and artifacts, output of the stage.
    model = c.get_logged_model(model_id)
    assert str(model.status).endswith("READY")
    assert model.source_run_id == by_stage["policy_checkpoint"].info.run_id
    assert model.params["lr"] == "1e-05"
    assert {m.key: m.value for m in model.metrics} == {"loss": 0.25, "kl": 0.01}
    assert [f.path for f in c.list_logged_model_artifacts(model_id)] == ["config.json"]
    outputs = by_stage["policy_checkpoint"].outputs.model_outputs
    assert [(o.model_id, o.step) for o in outputs] == [(model_id, 1)]
    url = run_url(uri, parent)
    assert url == f"http://127.0.0.1:5000/#/experiments/{run.info.experiment_id}/runs/{parent}"
    assert run_url(uri, parent, ui_url="http://ui:8080/").startswith("http://ui:8080/#/experiments/")


def test_cycle_metrics_let_ipd_be_recomputed(store):
    uri, _ = store
    c = client(uri)
    experiment = EXPERIMENT + "-ipd"
    prices = PriceTable()
    campaign = Campaign()
    cycles = [
        # rollouts: 2 core-h * 0.048 + 0.1 H100-h * 2.99 = 0.395; learner: 0.5 * 0.048 + 0.2 * 2.99 = 0.622
        (1, 0.40, 0.55, True, [StageCost("rollouts", 7200, {"H100": 360}), StageCost("learner", 1800, {"H100": 720})]),
        # 1 core-h * 0.048 + (1200/3600) H100-h * 2.99 = 0.048 + 0.996667 = 1.044667
        (2, 0.55, 0.53, False, [StageCost("rollouts", 3600, {"H100": 1200})]),
    ]
    run_ids = []
    for cycle, champion, candidate, deployed, stages in cycles:
        run_id = start_cycle_run(uri, experiment, cycle)
        cost = cycle_cost(stages, prices)
        record = CycleRecord(cycle, champion, candidate, cost.dollars, deployed, (champion - 0.05, champion + 0.05),
                             (candidate - 0.05, candidate + 0.05), "set-a")  # fmt: skip
        campaign.add(record)
        logged = log_cycle_metrics(uri, run_id, record, campaign, cost)
        run_ids.append(run_id)
        if cycle == 2:
            RunLog(uri, run_id).log_figure(ipd_figure(campaign), "plots/ipd.png")
        end_run(uri, run_id)

    # Hand arithmetic: cycle 1 ipd = 0.15 / 1.017; cycle 2 ipd = -0.02 / 1.044667;
    # cumulative after 2 = (0.55 - 0.40) / (1.017 + 1.044667) = 0.072757.
    h1 = c.get_metric_history(run_ids[0], "intelligence_per_dollar")
    assert [(m.step, m.value) for m in h1] == [(1, pytest.approx(0.15 / 1.017))]
    h2 = c.get_metric_history(run_ids[1], "intelligence_per_dollar")
    assert [(m.step, m.value) for m in h2] == [(2, pytest.approx(-0.02 / 1.044667, rel=1e-5))]
    cum = c.get_metric_history(run_ids[1], "cumulative_intelligence_per_dollar")
    assert cum[0].step == 2 and cum[0].value == pytest.approx(0.072757, abs=1e-6)
    m2 = c.get_run(run_ids[1]).data.metrics
    assert m2["cost_usd"] == pytest.approx(1.044667, rel=1e-5)
    assert m2["campaign_cost_usd"] == pytest.approx(2.061667, rel=1e-5)
    assert m2["cost_usd_stage.rollouts"] == pytest.approx(1.044667, rel=1e-5)
    assert m2["deployed"] == 0.0 and m2["candidate_ci_hi"] == pytest.approx(0.58)
    assert logged["cumulative_intelligence_per_dollar"] == pytest.approx(0.072757, abs=1e-6)
    # The logged inputs are enough to rebuild the campaign and recompute both numbers.
    again = load_campaign(uri, experiment)
    assert [r.cycle for r in again.records] == [1, 2]
    assert again.cumulative_ipd() == pytest.approx(0.072757, abs=1e-6)
    assert again.records[0].ipd == pytest.approx(0.15 / 1.017)
    assert again.comparable and again.records[1].eval_set_hash == "set-a"
    assert "plots/ipd.png" in [f.path for f in c.list_artifacts(run_ids[1], "plots")]
    assert "cost/cycle-2.json" in [f.path for f in c.list_artifacts(run_ids[1], "cost")]
    with pytest.raises(TrackingError, match="add the record"):
        log_cycle_metrics(uri, run_ids[1], CycleRecord(3, 0.5, 0.6, 1.0, True), campaign)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(240)
def test_mlflow_server_starts_serves_reuses_and_stops(tmp_path, monkeypatch):
    from ops.serving import mlflow_server

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    h = Home(tmp_path / "home")
    port = _free_port()
    server = mlflow_server.start(h, port=port, timeout_s=180)
    try:
        assert not server.reused and mlflow_server.health(server.url)
        assert tracking_uri(h=h) == server.url  # a running server of this home is the store's front
        assert mlflow_server.pid_file(h).exists()
        again = mlflow_server.start(h, port=port)
        assert again.reused and again.pid == server.pid
        # A cycle run through the server, with an artifact in the store's artifacts dir.
        run_id = start_cycle_run(server.url, "served", cycle=7)
        RunLog(server.url, run_id).log_dict({"ok": True}, "probe.json")
        assert client(server.url).get_run(run_id).data.tags["perpetua.cycle"] == "7"
        assert list((h.mlflow / "artifacts").rglob("probe.json"))
        assert run_url(server.url, run_id).startswith(server.url + "/#/experiments/")
    finally:
        assert mlflow_server.stop(h)
    assert not mlflow_server.health(server.url)
    assert mlflow_server.status(h) is None and not mlflow_server.pid_file(h).exists()
    assert not mlflow_server.stop(h)
    # With the server stopped, the store is still whole: a run the Dagster daemon launches later
    # writes the SQLite store directly, into the experiment the server created.
    direct = local_store(h.mlflow)[0]
    assert tracking_uri(h=h) == direct
    experiment = client(direct).get_experiment(client(direct).get_run(run_id).info.experiment_id)
    assert experiment.artifact_location.startswith((h.mlflow / "artifacts").resolve().as_uri())
    RunLog(direct, run_id).log_dict({"ok": "direct"}, "after.json")
    assert client(direct).download_artifacts(run_id, "after.json", str(tmp_path))
    assert json.loads((tmp_path / "after.json").read_text()) == {"ok": "direct"}
