"""Which environment a PERPETUA_HOME trains.

A home trains one environment: its base policy's tokenizer and fine-tuning come from that
environment's text, and every task, rollout and eval set after it does too. The choice is made
when the home's base policy is built (`PERPETUA_ENVIRONMENT`, default `calculator`, or
`perpetua demo --env NAME`) and recorded in PERPETUA_HOME/environment.json; every stage reads it
from there, and a different PERPETUA_ENVIRONMENT on a home that already has one is refused with
a clear error rather than mixing two environments' data.
"""

from __future__ import annotations

import json
import os

from ops.common.atomic import atomic_write_text
from ops.common.paths import Home, home as default_home
from ops.envs import Environment, get_environment

ENV_VAR = "PERPETUA_ENVIRONMENT"
RECORD = "environment.json"


class EnvironmentMismatch(ValueError):
    pass


def home_environment(h: Home | None = None) -> Environment:
    """The environment of the home (its record), else the one PERPETUA_ENVIRONMENT names, else the
    calculator world. Reading never writes: `bind_environment` records the choice."""
    h = h or default_home()
    asked = os.environ.get(ENV_VAR) or None
    recorded = recorded_environment(h)
    if recorded is None:
        return get_environment(asked)
    if asked and asked != recorded["name"]:
        raise EnvironmentMismatch(
            f"PERPETUA_HOME {h.root} trains the {recorded['name']!r} environment, not {asked!r}: use another "
            f"PERPETUA_HOME for {asked!r} (or unset {ENV_VAR})")
    return get_environment(recorded["name"])


def recorded_environment(h: Home | None = None) -> dict | None:
    path = (h or default_home()).root / RECORD
    return json.loads(path.read_text()) if path.exists() else None


def bind_environment(env: Environment, h: Home | None = None) -> None:
    """Record that the home trains `env` (its name and current version)."""
    h = h or default_home()
    h.root.mkdir(parents=True, exist_ok=True)
    if recorded_environment(h) != env.identity():
        atomic_write_text(h.root / RECORD, json.dumps(env.identity(), indent=1))


def stage_code_version(base: str, h: Home | None = None) -> str:
    """A stage's Dagster code version in the home's environment: `base` in the calculator world's
    first version (whose stored data predates environments and stays current), else
    `base+NAME-VERSION`, so Dagster marks data made by another environment version stale.

    Read when the definitions load; a home whose environment cannot be resolved (a mismatch, an
    uninstalled plugin) gets `base` here and the stage's own clear error when it runs."""
    from ops.envs import UnknownEnvironment

    try:
        env = home_environment(h)
    except (EnvironmentMismatch, UnknownEnvironment):
        return base
    return base if env.identity() == CALCULATOR_V1 else f"{base}+{env.code_version()}"


CALCULATOR_V1 = {"name": "calculator", "version": "1"}
