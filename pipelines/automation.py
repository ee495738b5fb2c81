"""Switching the loop's automation on in the Dagster instance: the retraining sensor and the
schedules.

They are defined stopped, so a new deployment never starts training by itself; `perpetua demo`
switches them on once its own cycles are done, and from then on the daemon (`dagster dev`, or
`dagster-daemon run`) keeps the loop going: harvests every few minutes, a cycle whenever enough
new failures have landed, a full eval at night.

Dagster keys an instigator's on/off state by its code-location origin. Starting them through
Dagster's own CLI against `workspace.yaml` gives them the origin that `dagster dev -w
workspace.yaml` loads, so the UI shows them running; state written from another origin (an
in-process repository, say) would be invisible there.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from pipelines.schedules import SCHEDULES
from pipelines.sensors import SENSORS

WORKSPACE = Path(__file__).resolve().parent.parent / "workspace.yaml"
INSTIGATORS = [s.name for s in SENSORS] + [s.name for s in SCHEDULES]


class AutomationError(RuntimeError):
    """Dagster's CLI could not switch an instigator on; the message carries its output."""


def switch_on(dagster_home: Path, workspace: Path = WORKSPACE, timeout_s: float = 300.0) -> dict[str, str]:
    """Start every sensor and schedule of the code location in the instance at `dagster_home`;
    returns `status()` afterwards. Idempotent: starting a running instigator leaves it running."""
    env = {**os.environ, "DAGSTER_HOME": str(dagster_home)}
    running = {n for n, s in status(dagster_home).items() if s == "RUNNING"}
    calls = []
    for kind in ("sensor", "schedule"):
        names = [n for n in _names(kind) if n not in running]
        # One CLI call (a code-location load) per kind; --start-all refuses an instigator that
        # already runs, so after a partial start the rest are started one by one.
        calls += [(kind, args) for args in ([["--start-all"]] if len(names) == len(_names(kind)) else [[n] for n in names])]
    # The calls write different instigators' state, so they run side by side: each spends most
    # of its time loading the code location.
    procs = [(kind, args, subprocess.Popen([sys.executable, "-m", "dagster", kind, "start", *args, "-w", str(workspace)],
                                           env=env, cwd=workspace.parent, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                           text=True)) for kind, args in calls]
    failures = []
    for kind, args, proc in procs:
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            err = f"timed out after {timeout_s:.0f} s. {err}"
        if proc.returncode != 0:
            failures.append(f"`dagster {kind} start {' '.join(args)}` failed: {(err or out).strip()[-2000:]}")
    if failures:
        raise AutomationError("; ".join(failures))
    return status(dagster_home)


def status(dagster_home: Path) -> dict[str, str]:
    """RUNNING or STOPPED for each sensor and schedule of the code location, as the instance
    stores it (an instigator never switched on has no stored state: its default, STOPPED)."""
    import dagster as dg

    with dg.DagsterInstance.from_config(str(dagster_home)) as instance:
        stored = {s.instigator_name: s.status.value for s in instance.all_instigator_state()}
    return {name: ("RUNNING" if stored.get(name) in ("RUNNING", "DECLARED_IN_CODE") else "STOPPED") for name in INSTIGATORS}


def _names(kind: str) -> list[str]:
    return [s.name for s in (SENSORS if kind == "sensor" else SCHEDULES)]
