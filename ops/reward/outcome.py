"""What one sandboxed run came to: a typed `Outcome` and the `SandboxResult` around it.

The outcome is decided from facts the sandbox observed itself (its own timeout and output
limit, the exit status, the CPU time of the reaped tree) before any text the command wrote.
The markers are read from the command's own stderr, so untrusted code can only move itself
between failing outcomes, never into `pass`.
"""

from __future__ import annotations

import enum
import signal
from dataclasses import asdict, dataclass, field

from ops.reward.isolation import Isolation
from ops.reward.limits import Limits


class Outcome(str, enum.Enum):
    PASS = "pass"
    FAIL = "fail"
    TIMEOUT = "timeout"
    CRASHED = "crashed"
    RESOURCE_LIMIT = "resource-limit"
    SANDBOX_VIOLATION = "sandbox-violation"

    def __str__(self) -> str:  # so f-strings and JSON show the wire value
        return self.value


@dataclass(frozen=True)
class SandboxResult:
    outcome: Outcome
    exit_code: int | None  # shell convention: 128+N when killed by signal N
    seconds: float
    stdout: str
    stderr: str
    signal: int | None = None
    cpu_seconds: float = 0.0  # of the reaped tree; under bwrap only bwrap's own share is visible
    stdout_bytes: int = 0  # produced, not kept
    stderr_bytes: int = 0
    truncated: bool = False
    isolation: Isolation = "bwrap"
    reason: str = ""
    violations: list[str] = field(default_factory=list)
    workdir_cap_bytes: int | None = None  # the work directory's size cap; None: uncapped (ops/reward/workdir.py)

    @property
    def ok(self) -> bool:
        return self.outcome is Outcome.PASS

    def to_json(self) -> dict:
        """The `perpetua sandbox --json` object: the fixed keys first, then extras."""
        d = asdict(self)
        d["outcome"] = self.outcome.value
        fixed = {k: d.pop(k) for k in ("outcome", "exit_code", "seconds", "stdout", "stderr")}
        return {**fixed, **d}


_RESOURCE_MARKERS = (
    "MemoryError", "Cannot allocate memory", "Resource temporarily unavailable",
    "File too large", "Too many open files", "RecursionError",
)
_VIOLATION_MARKERS = (
    "Read-only file system", "Network is unreachable", "Operation not permitted",
    "Permission denied", "Connection refused", "Temporary failure in name resolution",
    "Name or service not known", "Cannot assign requested address",
)


SANDBOX_START_FAILED = "sandbox failed to start"


def is_infra(result: "SandboxResult") -> bool:
    """The sandbox itself failed (bwrap could not set up, the process could not be spawned):
    an infrastructure failure, retried and never a reward."""
    return result.outcome is Outcome.CRASHED and result.reason.startswith((SANDBOX_START_FAILED, "could not start"))


def signal_of(code: int) -> int | None:
    """The signal behind a shell-convention exit code (128+N), if any."""
    return code - 128 if code > 128 and code - 128 < signal.NSIG else None


def classify(
    *, code: int, timed_out: bool, output_exceeded: bool, cpu_seconds: float, limits: Limits,
    stderr: str, isolation: Isolation,
) -> tuple[Outcome, str, list[str]]:
    """(outcome, reason, violation markers seen in stderr) of a finished run."""
    sig = signal_of(code)
    violations = [m for m in _VIOLATION_MARKERS if m in stderr]
    if timed_out:
        return Outcome.TIMEOUT, f"wall-clock limit of {limits.wall_seconds:g}s reached; process tree killed", violations
    if output_exceeded:
        return Outcome.RESOURCE_LIMIT, f"wrote more than {limits.output_limit_bytes} bytes of output; killed", violations
    if sig in (signal.SIGXCPU, signal.SIGXFSZ):
        return Outcome.RESOURCE_LIMIT, f"killed by {signal.Signals(sig).name}", violations
    if sig == signal.SIGKILL and cpu_seconds >= limits.cpu_seconds - 0.05:
        return Outcome.RESOURCE_LIMIT, f"CPU limit of {limits.cpu_seconds}s reached", violations
    if code == 0:
        return Outcome.PASS, "exit 0", violations
    if isolation == "bwrap" and code == 1 and stderr.startswith("bwrap:"):
        return Outcome.CRASHED, f"{SANDBOX_START_FAILED}: {stderr.strip()[:200]}", violations
    if code in (126, 127):
        return Outcome.CRASHED, f"exit {code}: the command could not be executed", violations
    if hits := [m for m in _RESOURCE_MARKERS if m in stderr]:
        return Outcome.RESOURCE_LIMIT, f"exit {code}: {hits[0]}", violations
    if violations:
        return Outcome.SANDBOX_VIOLATION, f"exit {code}: {violations[0]}", violations
    if sig is not None:
        return Outcome.CRASHED, f"killed by {signal.Signals(sig).name}", violations
    return Outcome.FAIL, f"exit {code}", violations
