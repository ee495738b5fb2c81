"""The Model Registry: which policy version is the champion, and a deploy that cannot half-happen.

A candidate checkpoint (its HF export dir) is registered as a new version of a registered model.
Two aliases say what is deployed: `champion` (served now) and `previous-champion` (what
`rollback` returns to). Stages are deprecated in MLflow; aliases are the supported way.

A deploy has two sides that must agree: the serving engine (refit to the new weights) and the
registry (the `champion` alias). `deploy` orders them so that a failure anywhere leaves both on
the old champion:
1. refit the server to the new version (the callback); if it raises, nothing in the registry
   has changed;
2. move the aliases, `previous-champion` first and `champion` last, so the `champion` write is
   the single commit point; if it fails, `previous-champion` is restored and the server is
   refit back to the old champion.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping
from urllib.parse import unquote, urlparse

from ops.common import faults
from ops.common.tracking import TAG_MODEL_ID, TAG_POLICY_VERSION, client, ensure_experiment

CHAMPION = "champion"
PREVIOUS = "previous-champion"

Refit = Callable[[str, str], None]  # (version, local model dir) -> None; raises on failure


class RegistryError(RuntimeError):
    """The registry is not in a state that allows the request (unknown model or version, ...)."""


class DeployError(RuntimeError):
    """A deploy or rollback did not happen; the message says what state it left."""


@dataclass(frozen=True)
class AliasState:
    champion: str | None
    previous: str | None


def aliases(tracking_uri: str, name: str, missing_ok: bool = False) -> AliasState:
    """The aliases of registered model `name`; with `missing_ok`, none when the model does not
    exist yet (nothing was ever registered), instead of a RegistryError."""
    from mlflow.exceptions import MlflowException

    try:
        model = client(tracking_uri).get_registered_model(name)
    except MlflowException as e:
        if missing_ok and e.error_code == "RESOURCE_DOES_NOT_EXIST":
            return AliasState(champion=None, previous=None)
        raise RegistryError(f"no registered model {name!r} in {tracking_uri}: {e.message}") from None
    a = {k: str(v) for k, v in (model.aliases or {}).items()}  # MLflow returns versions as ints here
    return AliasState(champion=a.get(CHAMPION), previous=a.get(PREVIOUS))


def champion_version(tracking_uri: str, name: str) -> str | None:
    """The version the `champion` alias points at, or None before the first deploy."""
    return aliases(tracking_uri, name).champion


def champion_policy_version(tracking_uri: str, name: str) -> tuple[str | None, int]:
    """(registry version, policy version) of the champion; (None, 0), the base policy, before the
    first deploy (also when nothing was ever registered)."""
    version = aliases(tracking_uri, name, missing_ok=True).champion
    if version is None:
        return None, 0
    return version, held_policy_version(tracking_uri, name, version) or 0


def held_policy_version(tracking_uri: str, name: str, version: str) -> int | None:
    """The policy version registry version `version` holds (its tag), None when untagged."""
    tag = client(tracking_uri).get_model_version(name, version).tags.get(TAG_POLICY_VERSION)
    return int(tag) if tag not in (None, "") else None


def _check_version(tracking_uri: str, name: str, version: str) -> None:
    from mlflow.exceptions import MlflowException

    try:
        client(tracking_uri).get_model_version(name, str(version))
    except MlflowException:
        raise RegistryError(f"model {name!r} has no version {version!r}") from None


def register_candidate(
    tracking_uri: str,
    model_dir: str | Path | None,
    name: str,
    tags: Mapping[str, str] | None = None,
    *,
    run_id: str | None = None,
    model_id: str | None = None,
    experiment: str = "perpetua-registry",
) -> str:
    """Register a checkpoint as a new version of `name`; returns the version.

    `model_dir` (the HF export) is logged as artifacts `model/` of `run_id` (a fresh run in
    `experiment` if none) and the version's source is that run artifact URI. With
    `model_dir=None`, the artifacts of the LoggedModel `model_id` are registered instead
    (no second upload). `model_id` links the version to its LoggedModel either way.
    """
    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import RESOURCE_ALREADY_EXISTS, ErrorCode

    c = client(tracking_uri)
    if model_dir is not None:
        path = Path(model_dir)
        if not path.is_dir() or not any(path.iterdir()):
            raise RegistryError(f"model dir {path} does not exist or is empty")
        own_run = run_id is None
        if own_run:
            run_id = c.create_run(ensure_experiment(tracking_uri, experiment), run_name=f"register-{name}").info.run_id
        c.log_artifacts(run_id, str(path), "model")
        if own_run:
            c.set_terminated(run_id, "FINISHED")
        source = f"{c.get_run(run_id).info.artifact_uri.rstrip('/')}/model"
    elif model_id is not None:
        logged = c.get_logged_model(model_id)
        source, run_id = logged.artifact_location, run_id or logged.source_run_id
    else:
        raise RegistryError("register_candidate needs a model_dir or a model_id")
    try:
        c.create_registered_model(name)
    except MlflowException as e:
        if e.error_code != ErrorCode.Name(RESOURCE_ALREADY_EXISTS):
            raise
    version_tags = {k: str(v) for k, v in (tags or {}).items()}
    if model_id is not None:
        version_tags[TAG_MODEL_ID] = model_id  # the SQL registry store does not keep model_id itself
    # run_id is always set here: with run_id None and a model_id, MLflow's SQL store would look
    # the model up through the *global* client (the default tracking URI), not this store.
    # With its own artifacts (model_dir) the version is linked to the LoggedModel by the tag and
    # the model's registry tag only: MLflow refuses a source outside the LoggedModel's artifacts
    # when model_id is passed here.
    mv = c.create_model_version(name, source=source, run_id=run_id, tags=version_tags,
                                model_id=model_id if model_dir is None else None)
    version = str(mv.version)
    if model_id is not None:
        _link_logged_model(tracking_uri, model_id, name, version)
    return version


def _link_logged_model(tracking_uri: str, model_id: str, name: str, version: str) -> None:
    # The same tag `mlflow.register_model` writes, so the UI shows the model's registered versions.
    from mlflow.utils.mlflow_tags import MLFLOW_MODEL_VERSIONS

    c = client(tracking_uri)
    existing = c.get_logged_model(model_id).tags.get(MLFLOW_MODEL_VERSIONS)
    value = (json.loads(existing) if existing else []) + [{"name": name, "version": version}]
    c.set_logged_model_tags(model_id, {MLFLOW_MODEL_VERSIONS: json.dumps(value)})


def version_model_id(tracking_uri: str, name: str, version: str) -> str | None:
    """The LoggedModel (checkpoint) a registered version came from, if it was linked."""
    mv = client(tracking_uri).get_model_version(name, str(version))
    return mv.model_id or mv.tags.get(TAG_MODEL_ID)


def model_dir(tracking_uri: str, name: str, version: str, dst: str | Path | None = None) -> Path:
    """A local directory holding the version's files: the store itself for a local file store,
    otherwise a download into `dst` (a temporary directory if None)."""
    import mlflow.artifacts

    _check_version(tracking_uri, name, version)
    uri = client(tracking_uri).get_model_version_download_uri(name, str(version))
    parsed = urlparse(uri)
    if parsed.scheme in ("", "file"):
        return Path(unquote(parsed.path))
    local = mlflow.artifacts.download_artifacts(
        artifact_uri=uri, dst_path=str(dst) if dst else None, tracking_uri=tracking_uri
    )
    return Path(local)


# ---- moving the aliases -------------------------------------------------------------------


def _set(tracking_uri: str, name: str, alias: str, version: str | None) -> None:
    c = client(tracking_uri)
    if version is None:
        c.delete_registered_model_alias(name, alias)
    else:
        c.set_registered_model_alias(name, alias, str(version))


def _move(tracking_uri: str, name: str, champion: str, previous: str | None, before: AliasState) -> None:
    """Write previous-champion, then champion (the commit point); undo the first on failure."""
    if previous is not None and previous != before.previous:
        _set(tracking_uri, name, PREVIOUS, previous)
    try:
        _set(tracking_uri, name, CHAMPION, champion)
    except Exception as e:
        try:
            if before.previous != previous:
                _set(tracking_uri, name, PREVIOUS, before.previous)
        except Exception as undo:
            raise RegistryError(
                f"{name}: setting champion -> v{champion} failed ({e}), and restoring previous-champion -> "
                f"v{before.previous} failed too ({undo}); champion is still v{before.champion}"
            ) from e
        raise RegistryError(
            f"{name}: setting champion -> v{champion} failed ({e}); aliases restored "
            f"(champion v{before.champion}, previous-champion v{before.previous})"
        ) from e


def promote(tracking_uri: str, name: str, version: str) -> AliasState:
    """Point `champion` at `version` and `previous-champion` at the old champion (registry only;
    `deploy` also refits the server). Returns the new state."""
    version = str(version)
    _check_version(tracking_uri, name, version)
    before = aliases(tracking_uri, name)
    if before.champion == version:
        return before
    previous = before.champion if before.champion is not None else before.previous
    _move(tracking_uri, name, version, previous, before)
    return AliasState(champion=version, previous=previous)


def _refit_then_promote(tracking_uri: str, name: str, target: str, refit: Refit | None, what: str) -> AliasState:
    before = aliases(tracking_uri, name)
    if refit is not None:
        try:
            refit(target, str(model_dir(tracking_uri, name, target)))
        except Exception as e:
            raise DeployError(
                f"{what} of {name} v{target}: refit failed ({type(e).__name__}: {e}); "
                f"registry unchanged, champion is still v{before.champion}"
            ) from e
    faults.point(faults.DEPLOY_AFTER_REFIT)  # a kill here is undone by reconcile_champion at the next start
    try:
        return promote(tracking_uri, name, target)
    except Exception as e:
        if refit is None:
            raise DeployError(f"{what} of {name} v{target}: {e}") from e
        if before.champion is None:
            raise DeployError(
                f"{what} of {name} v{target}: {e}; there is no old champion to refit back to, so the server "
                f"serves v{target} while the registry has no champion: deploy again"
            ) from e
        try:
            refit(before.champion, str(model_dir(tracking_uri, name, before.champion)))
        except Exception as back:
            raise DeployError(
                f"{what} of {name} v{target}: alias update failed ({e}) and refitting the server back to "
                f"v{before.champion} failed ({back}); the server may serve v{target} while the registry "
                f"says v{before.champion}: run `perpetua rollback` or deploy again"
            ) from e
        raise DeployError(f"{what} of {name} v{target}: {e}; the server was refit back to v{before.champion}") from e


def deploy(tracking_uri: str, name: str, version: str, refit: Refit) -> AliasState:
    """Refit the server to `version`, then make it the champion; all or nothing (module doc)."""
    version = str(version)
    _check_version(tracking_uri, name, version)
    if champion_version(tracking_uri, name) == version:
        return aliases(tracking_uri, name)
    return _refit_then_promote(tracking_uri, name, version, refit, "deploy")


def rollback(tracking_uri: str, name: str, refit: Refit | None = None) -> AliasState:
    """Make the previous champion the champion again (and serve it, when `refit` is given);
    the two aliases swap, so a second rollback undoes the first."""
    before = aliases(tracking_uri, name)
    if before.previous is None or before.previous == before.champion:
        raise RegistryError(f"{name} has no previous champion to roll back to (champion v{before.champion})")
    return _refit_then_promote(tracking_uri, name, before.previous, refit, "rollback")
