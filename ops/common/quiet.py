"""Warnings that tell a user of this project nothing, silenced in one place for every entry point
(the `perpetua` command, the learner process, the Dagster code location).

- megatron-core on a machine without Transformer Engine or Apex falls back to torch kernels and
  says so on import, once per module (expected on CPU; see ops/policy/megatron_cpu.py);
- Dagster marks preview/beta APIs the project uses on purpose (Pipes' writer count);
- MLflow hints that an integer column cannot hold missing values when a dataset is logged
  (the rollout tables have none).
Everything else still warns.

MLflow's usage telemetry is off unless the user sets `MLFLOW_DISABLE_TELEMETRY` themselves: its
background thread sets and unsets an environment variable while other threads read
`os.environ`, which failed a cycle's MLflow call with `KeyError: '_MLFLOW_TELEMETRY_SESSION_ID'`
(from `requests`' proxy lookup), and nothing here should call out of the machine.
"""

from __future__ import annotations

import os
import warnings

KNOWN = [
    r".*(Transformer Engine|Apex)( and Apex)? (is|are) not installed",
    r".*full scope is deprecated",
    r".* is currently in (preview|beta)",
    r"Hint: Inferred schema contains integer column",
]


def quiet_known_warnings() -> None:
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")  # before mlflow is imported (it starts the thread)
    for pattern in KNOWN:
        warnings.filterwarnings("ignore", message=pattern)
