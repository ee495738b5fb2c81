"""Which model versions a harvest accepts: a record from a version the registry does not know
is quarantined (unknown_model_version), so traffic from a model we never trained or deployed
never becomes training data."""

from __future__ import annotations

import os

from ops.common import tracking
from ops.common.paths import Home, home as default_home


def registry_model_versions(tracking_uri: str, model_name: str) -> set[str]:
    """Versions of a registered model (the production way to know which versions are real)."""
    client = tracking.client(tracking_uri)
    return {str(v.version) for v in client.search_model_versions(f"name = '{model_name}'")}


def resolve_known_versions(
    explicit: list[str] | None = None,
    tracking_uri: str | None = None,
    model_name: str = tracking.REGISTERED_MODEL,
    home: Home | None = None,
) -> tuple[frozenset[str], str]:
    """The model versions a harvest accepts, and where they came from.

    In order: an explicit list; env PERPETUA_KNOWN_MODEL_VERSIONS (comma-separated); the MLflow
    registry where the project's one rule finds it (ops.common.tracking.tracking_uri: `tracking_uri`,
    MLFLOW_TRACKING_URI, this home's running server, its SQLite store if it exists). With none of
    them there is no known version, and the harvest refuses to run rather than quarantine."""
    if explicit is not None:
        return frozenset(explicit), "explicit"
    env = os.environ.get("PERPETUA_KNOWN_MODEL_VERSIONS")
    if env is not None:
        return frozenset(v.strip() for v in env.split(",") if v.strip()), "env PERPETUA_KNOWN_MODEL_VERSIONS"
    uri = tracking.existing_tracking_uri(tracking_uri, home or default_home())
    if uri is None:
        return frozenset(), "none (no registry found)"
    return frozenset(registry_model_versions(uri, model_name)), f"registry {model_name} at {uri}"
