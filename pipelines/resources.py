"""Resources per deployment, chosen by PERPETUA_ENV (local by default), as in Dagster's
project_fully_featured: the same assets run against the embedded default or a cluster."""

from __future__ import annotations

import os

import dagster as dg


def for_environment(env: str | None = None) -> dict:
    env = env or os.environ.get("PERPETUA_ENV", "local")
    if env not in ("local", "cluster"):
        raise ValueError(f"PERPETUA_ENV must be 'local' or 'cluster', got {env!r}")
    return {"pipes_subprocess_client": dg.PipesSubprocessClient()}
