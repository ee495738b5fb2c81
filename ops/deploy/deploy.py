"""One deploy, whoever asks for it: the deployment asset, the demo's first champion and
`perpetua rollback` all make a policy the served champion through `deploy_policy`, so none of
them can skip a step:

1. register the policy's HF export, unless the registry already holds that policy version
   (a retried deploy does not add a second registry version of the same checkpoint);
2. refit the production server to it (`serve`, the caller's callable: PolicyServer.serve under
   Dagster, so this module needs no Dagster);
3. check that the server now serves the policy version the registry version holds;
4. move the `champion` alias (the old champion becomes `previous-champion`);
5. write the champion pointer file (PERPETUA_HOME/models/champion.json), which commands that
   run without MLflow (parity) read.

Steps 2-4 are registry.deploy's all-or-nothing ordering: a refit or check that fails leaves the
aliases as they were, and a failed alias write refits the server back to the old champion.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

from ops.common.paths import Home, home
from ops.common.tracking import REGISTERED_MODEL, TAG_POLICY_VERSION, client
from ops.deploy import registry
from ops.deploy.registry import DeployError, RegistryError
from ops.policy import versions as policies

Serve = Callable[[Path], int]  # refit the production server to a model dir; returns the policy version it serves


@dataclass(frozen=True)
class Deployed:
    registry_version: str
    policy_version: int  # what the server reported serving after the refit
    previous: str | None  # the `previous-champion` alias afterwards
    registered: bool  # a new registry version was created for this deploy


def pointer_file(h: Home | None = None) -> Path:
    return (h or home()).models / "champion.json"


def write_champion_pointer(registry_version: str, policy_version: int, h: Home | None = None) -> Path:
    """Record the served champion where MLflow-free readers find it."""
    path = pointer_file(h)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"registry_version": str(registry_version), "policy_version": policy_version,
                                "hf_dir": str(policies.hf_dir(policy_version, h))}))
    return path


def registered_version(tracking_uri: str, policy_version: int, name: str = REGISTERED_MODEL) -> str | None:
    """The newest registry version of `name` that holds `policy_version`, if any."""
    found = client(tracking_uri).search_model_versions(
        f"name = '{name}' and tags.`{TAG_POLICY_VERSION}` = '{int(policy_version)}'")
    return str(max(int(mv.version) for mv in found)) if found else None


def deploy_policy(
    tracking_uri: str,
    serve: Serve,
    *,
    policy_version: int | None = None,
    registry_version: str | None = None,
    name: str = REGISTERED_MODEL,
    tags: Mapping[str, object] | None = None,
    run_id: str | None = None,
    model_id: str | None = None,
    h: Home | None = None,
) -> Deployed:
    """Make a policy the served champion (module doc). Name it by exactly one of
    `policy_version` (its HF export under PERPETUA_HOME, registered with `tags` and as artifacts
    of `run_id` when new, linked to the LoggedModel `model_id` when given) or `registry_version`
    (a version the registry holds, e.g. the previous champion). Deploying the champion again refits the server if it serves something else.
    Raises DeployError (state unchanged, or as the message says) or RegistryError."""
    if (policy_version is None) == (registry_version is None):
        raise ValueError("deploy_policy needs exactly one of policy_version and registry_version")
    registered = False
    if policy_version is not None:
        registry_version = registered_version(tracking_uri, policy_version, name)
        if registry_version is None:
            registry_version = registry.register_candidate(
                tracking_uri, policies.hf_dir(policy_version, h), name, run_id=run_id, model_id=model_id,
                tags={**(tags or {}), TAG_POLICY_VERSION: policy_version})
            registered = True
    version = str(registry_version)
    expected = policy_version if policy_version is not None else registry.held_policy_version(tracking_uri, name, version)
    before = registry.aliases(tracking_uri, name)
    served: list[int] = []

    def serve_old_champion() -> str:
        """After a refit that served the wrong policy: serve the old champion again, say so."""
        if before.champion in (None, version):
            return ""
        return f"; the server was refit back to v{before.champion} (policy v{serve(registry.model_dir(tracking_uri, name, before.champion))})"

    def refit(target: str, local_dir: str) -> None:
        now = serve(Path(local_dir))
        want = expected if target == version else registry.held_policy_version(tracking_uri, name, target)
        if want is not None and now != want:
            undone = serve_old_champion() if target == version else ""
            raise DeployError(f"the server serves policy v{now} after a refit to {name} v{target}, which holds policy v{want}{undone}")
        served.append(now)

    if before.champion == version:
        try:
            refit(version, str(registry.model_dir(tracking_uri, name, version)))
        except Exception as e:
            raise DeployError(f"serving champion {name} v{version}: {type(e).__name__}: {e}; registry unchanged") from e
        state = before
    else:
        state = registry.deploy(tracking_uri, name, version, refit)
    write_champion_pointer(version, served[0], h)
    return Deployed(version, served[0], state.previous, registered)


def reconcile_champion(tracking_uri: str, serve: Serve, name: str = REGISTERED_MODEL, h: Home | None = None) -> Deployed | None:
    """Make the production server serve what the registry's `champion` alias names (None when
    nothing is deployed). The alias is the deploy's commit point: a deploy killed after the refit
    and before the alias moved leaves the server on a candidate the registry never made champion;
    this refits it back (a no-op refit when they agree). Called whenever production is started
    or taken over (the demo; `perpetua simulate` serves the champion's weights the same way)."""
    champion = registry.aliases(tracking_uri, name, missing_ok=True).champion
    if champion is None:
        return None
    return deploy_policy(tracking_uri, serve, registry_version=champion, name=name, h=h)


def rollback_policy(tracking_uri: str, serve: Serve, name: str = REGISTERED_MODEL, h: Home | None = None) -> Deployed:
    """Deploy the previous champion again: the aliases swap, so a second rollback undoes the first."""
    before = registry.aliases(tracking_uri, name)
    if before.previous is None or before.previous == before.champion:
        raise RegistryError(f"{name} has no previous champion to roll back to (champion v{before.champion})")
    return deploy_policy(tracking_uri, serve, registry_version=before.previous, name=name, h=h)
