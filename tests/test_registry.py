"""The Model Registry with champion aliases, against a real MLflow SQLite store."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ops.deploy import registry
from ops.deploy.registry import CHAMPION, PREVIOUS, DeployError, RegistryError
from ops.common.tracking import REGISTERED_MODEL as NAME, client, local_store, stage_run, start_cycle_run


@pytest.fixture(scope="module")
def uri(tmp_path_factory):
    return local_store(tmp_path_factory.mktemp("mlflow"))[0]


def export(tmp_path, version: int):
    d = tmp_path / f"hf-v{version}"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "mixtral", "policy_version": version}))
    (d / "model.safetensors").write_bytes(bytes([version]) * 64)
    return d


class Server:
    """Stands in for the vLLM server: remembers what it serves; can be told to fail."""

    def __init__(self):
        self.serving: str | None = None
        self.calls: list[str] = []
        self.fail_on: str | None = None

    def refit(self, version: str, model_dir: str) -> None:
        self.calls.append(version)
        if version == self.fail_on:
            raise RuntimeError("engine died during reload_weights")
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
        assert str(cfg["policy_version"]) == version  # the dir handed over holds that version
        self.serving = version


def alias_version(uri: str, alias: str) -> str | None:
    from mlflow.exceptions import MlflowException

    try:
        return str(client(uri).get_model_version_by_alias(NAME, alias).version)
    except MlflowException:
        return None


def test_register_deploy_interrupted_deploy_and_rollback(uri, tmp_path, monkeypatch):
    v1 = registry.register_candidate(uri, export(tmp_path, 1), NAME, {"policy_version": "1"})
    v2 = registry.register_candidate(uri, export(tmp_path, 2), NAME, {"policy_version": "2"})
    v3 = registry.register_candidate(uri, export(tmp_path, 3), NAME, {"policy_version": "3"})
    assert (v1, v2, v3) == ("1", "2", "3")
    mv = client(uri).get_model_version(NAME, v2)
    assert mv.tags["policy_version"] == "2" and mv.run_id
    assert registry.champion_version(uri, NAME) is None

    server = Server()
    state = registry.deploy(uri, NAME, v1, server.refit)
    assert (state.champion, state.previous) == ("1", None)
    state = registry.deploy(uri, NAME, v2, server.refit)
    assert (state.champion, state.previous) == ("2", "1")
    assert (alias_version(uri, CHAMPION), alias_version(uri, PREVIOUS)) == ("2", "1")
    assert server.serving == "2"

    # Interrupted deploy: the refit raises after registration -> registry untouched.
    server.fail_on = v3
    with pytest.raises(DeployError, match="refit failed.*champion is still v2"):
        registry.deploy(uri, NAME, v3, server.refit)
    assert (alias_version(uri, CHAMPION), alias_version(uri, PREVIOUS)) == ("2", "1")
    assert server.serving == "2"
    server.fail_on = None

    # The champion write (the commit point) fails after the refit succeeded: aliases are
    # restored and the server is refit back to the old champion.
    c = client(uri)
    real_set = c.set_registered_model_alias

    def flaky_set(name, alias, version):
        if alias == CHAMPION:
            raise ConnectionError("tracking server went away")
        return real_set(name, alias, version)

    monkeypatch.setattr(c, "set_registered_model_alias", flaky_set)
    server.calls.clear()
    with pytest.raises(DeployError, match="tracking server went away"):
        registry.deploy(uri, NAME, v3, server.refit)
    monkeypatch.undo()
    assert server.calls == ["3", "2"] and server.serving == "2"
    assert (alias_version(uri, CHAMPION), alias_version(uri, PREVIOUS)) == ("2", "1")

    # Rollback swaps the aliases (and refits); a second rollback undoes it.
    state = registry.rollback(uri, NAME, server.refit)
    assert (state.champion, state.previous) == ("1", "2") and server.serving == "1"
    assert (alias_version(uri, CHAMPION), alias_version(uri, PREVIOUS)) == ("1", "2")
    registry.rollback(uri, NAME)
    assert registry.champion_version(uri, NAME) == "2"

    # promote alone moves aliases without a refit; deploying the champion again is a no-op.
    registry.promote(uri, NAME, v3)
    assert (alias_version(uri, CHAMPION), alias_version(uri, PREVIOUS)) == ("3", "2")
    server.calls.clear()
    registry.deploy(uri, NAME, v3, server.refit)
    assert server.calls == []
    assert (registry.model_dir(uri, NAME, v3) / "model.safetensors").read_bytes() == bytes([3]) * 64


def test_register_from_logged_model_and_user_errors(uri, tmp_path):
    parent = start_cycle_run(uri, "perpetua-registry-test", cycle=1)
    with stage_run(uri, parent, "policy_checkpoint") as log:
        model_id = log.log_checkpoint("policy-v9", step=1, model_dir=export(tmp_path, 9))
    v = registry.register_candidate(uri, None, NAME + "-lm", model_id=model_id)
    assert registry.version_model_id(uri, NAME + "-lm", v) == model_id
    assert json.loads(client(uri).get_logged_model(model_id).tags["mlflow.modelVersions"]) == [
        {"name": NAME + "-lm", "version": v}
    ]
    assert client(uri).get_model_version(NAME + "-lm", v).run_id == log.run_id
    cfg = json.loads((registry.model_dir(uri, NAME + "-lm", v) / "config.json").read_text())
    assert cfg["policy_version"] == 9

    with pytest.raises(RegistryError, match="no previous champion"):
        registry.rollback(uri, NAME + "-lm")
    with pytest.raises(RegistryError, match="no version '42'"):
        registry.promote(uri, NAME + "-lm", "42")
    with pytest.raises(RegistryError, match="no registered model"):
        registry.champion_version(uri, "no-such-model")
    assert registry.champion_policy_version(uri, "no-such-model") == (None, 0)  # nothing deployed: the base policy
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(RegistryError, match="empty"):
        registry.register_candidate(uri, empty, NAME)


def test_register_an_export_linked_to_an_artifactless_logged_model_through_the_server(perpetua_home, tmp_path):
    """The deploy's way, through the MLflow server (which checks what a direct store does not): the
    HF export as the version's own artifacts, linked to the candidate's LoggedModel that the eval
    logged without artifacts. MLflow's server refuses model_id with a source outside the model's
    artifacts, so the link is the version's tag and the model's registry tag."""
    import socket

    from ops.common.paths import home
    from ops.serving import mlflow_server

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = mlflow_server.start(home(), port=port)
    try:
        uri = server.url
        parent = start_cycle_run(uri, "perpetua-registry-test", cycle=1)
        with stage_run(uri, parent, "evaluate") as log:
            eval_model = log.log_checkpoint("policy-v8", step=1)
        v = registry.register_candidate(uri, export(tmp_path, 8), NAME, model_id=eval_model)
        assert registry.version_model_id(uri, NAME, v) == eval_model
        assert json.loads(client(uri).get_logged_model(eval_model).tags["mlflow.modelVersions"]) == [{"name": NAME, "version": v}]
        assert json.loads((registry.model_dir(uri, NAME, v, dst=tmp_path / "dl") / "config.json").read_text())["policy_version"] == 8
    finally:
        mlflow_server.stop(home())
