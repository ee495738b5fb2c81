"""Fault points: named places in the writes that matter where a test can have the process killed.

A crash can land anywhere; the places where it does the most harm are between two writes that
must agree (a harvest's failures table and its cursor, a deploy's server refit and its alias
move), and the end of each stage, where its outputs exist but Dagster has not recorded them.
Each such place calls `point(name)`; when env PERPETUA_FAULT names it, the process
SIGKILLs itself there, exactly as an OOM killer or a power cut would (no cleanup, no finally).
The fault-injection tests (tests/test_faults.py, tests/test_learner_resume.py,
tests/test_cycle_job.py) run a stage or a whole cycle in a child process with the variable
set, then check that a rerun, or the next start, leaves everything consistent. Unset (always,
in production), a point costs one environment lookup.

With PERPETUA_FAULT_ONCE naming a file as well, only the first process to reach the point dies
(it creates the file); the processes after it pass. That is how a test kills a Dagster run
worker once and lets the run retry that follows it, which inherits the same environment, live.

Work a run hands to a long-lived process (the persistent learner, ops/learn/service.py) does not
inherit the run's environment: the run sends `carried()` with the request and that process arms
them for the request's duration (`armed`).
"""

from __future__ import annotations

import contextlib
import os
import signal

ENV = "PERPETUA_FAULT"
ONCE_ENV = "PERPETUA_FAULT_ONCE"

HARVEST_BEFORE_CURSOR = "harvest.before_cursor"  # the generation's tables are written, the cursor not yet
DEPLOY_AFTER_REFIT = "deploy.after_refit"  # the server serves the new version, the champion alias is not moved yet
LEARNER_AFTER_UPDATE = "learner.after_update"  # + ".<k>": after the step's k-th optimizer update
LEARNER_BEFORE_COMMIT = "learner.before_commit"  # checkpoint tensors written, COMPLETE marker not yet
LEARNER_BEFORE_EXPORT = "learner.before_export"  # checkpoint committed, the HF export of the new policy not yet
STAGE_DONE = "stage.done"  # + ".<asset>": the stage's writes are done, Dagster has not recorded its materialization


def stage_done(asset: str) -> None:
    """The point at the end of a cycle stage: everything it writes is written, and the run dies
    before Dagster records the materialization, so a re-execution runs the stage again over its
    own outputs (which must give the same result, not a second one)."""
    point(f"{STAGE_DONE}.{asset}")


def point(name: str) -> None:
    """SIGKILL this process here when env PERPETUA_FAULT is `name` (and, with PERPETUA_FAULT_ONCE,
    no process has died here before)."""
    if os.environ.get(ENV) != name:
        return
    once = os.environ.get(ONCE_ENV)
    if once:
        try:
            os.close(os.open(once, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        except FileExistsError:
            return
    os.kill(os.getpid(), signal.SIGKILL)


def carried() -> dict[str, str]:
    """This process's fault variables, for a long-lived process that does part of its work."""
    return {k: os.environ[k] for k in (ENV, ONCE_ENV) if k in os.environ}


@contextlib.contextmanager
def armed(variables: dict[str, str]):
    """The fault variables of a request (`carried()` by the caller) set for the block, the
    process's own restored after."""
    variables = {k: v for k, v in variables.items() if k in (ENV, ONCE_ENV)}
    saved = {k: os.environ.get(k) for k in (ENV, ONCE_ENV)}
    for k in (ENV, ONCE_ENV):
        os.environ.pop(k, None)
    os.environ.update(variables)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
