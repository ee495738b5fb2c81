"""Per-run resource limits of the sandbox, and the child-side half that applies them.

RLIMIT_NPROC counts every process of the *real uid*, not of the run: a run under its own uid
(bwrap as root, ops.reward.uid_pool) gets the budget plus a few for bwrap and setpriv; an
unprivileged run shares its uid with the host, so its budget is added to what that uid already
has. Root itself is exempt from RLIMIT_NPROC, which is why root runs drop to a uid of their own.
"""

from __future__ import annotations

import contextlib
import os
import resource
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field


class Limits(BaseModel):
    """Per-run limits. The defaults suit one verification; callers tighten or widen per run."""

    model_config = ConfigDict(frozen=True)

    wall_seconds: Annotated[float, Field(gt=0, description="Wall-clock limit; the whole process tree is killed when it passes.")] = 10.0
    cpu_seconds: Annotated[int, Field(ge=1, description="RLIMIT_CPU per process (SIGXCPU at the limit, SIGKILL one second later).")] = 10
    memory_bytes: Annotated[int, Field(ge=16 << 20, description="RLIMIT_AS: address space per process.")] = 1 << 30
    file_size_bytes: Annotated[int, Field(ge=0, description="RLIMIT_FSIZE: the largest file a process may write.")] = 64 << 20
    processes: Annotated[int, Field(ge=1, description="RLIMIT_NPROC: processes the sandboxed uid may have at once.")] = 64
    open_files: Annotated[int, Field(ge=16, description="RLIMIT_NOFILE: open file descriptors per process.")] = 256
    output_bytes: Annotated[int, Field(ge=256, description="Bytes of stdout and of stderr kept (head and tail); the rest is counted, not stored.")] = 64 << 10
    output_limit_bytes: Annotated[int, Field(ge=1, description="Total stdout+stderr after which the command is killed (resource-limit).")] = 16 << 20
    tmpfs_bytes: Annotated[int, Field(ge=1 << 20, description="Size of the private /tmp inside bwrap (tmpfs is RAM, so it is bounded).")] = 64 << 20
    workdir_bytes: Annotated[int, Field(ge=1 << 20, description="Size cap of the work directory: a tmpfs of this size where the verifier may mount one (ops/reward/workdir.py).")] = 512 << 20

    def but(self, **changes) -> "Limits":
        """A copy with some limits changed, validated."""
        return Limits(**{**self.model_dump(), **changes})


def process_budget(limits: Limits, *, own_uid: bool, bwrap: bool) -> int:
    """The RLIMIT_NPROC value for one run (see the module docstring)."""
    if own_uid or os.geteuid() == 0:
        return limits.processes + 4 if bwrap else limits.processes
    return _user_process_count(os.getuid()) + limits.processes


def preexec_limits(limits: Limits, nproc: int):
    """The child-side half, run between fork and exec: nothing here may take a lock."""
    settings = [
        (resource.RLIMIT_CPU, (limits.cpu_seconds, limits.cpu_seconds + 1)),
        (resource.RLIMIT_AS, (limits.memory_bytes, limits.memory_bytes)),
        (resource.RLIMIT_FSIZE, (limits.file_size_bytes, limits.file_size_bytes)),
        (resource.RLIMIT_NPROC, (nproc, nproc)),
        (resource.RLIMIT_NOFILE, (limits.open_files, limits.open_files)),
        (resource.RLIMIT_CORE, (0, 0)),
    ]

    def preexec() -> None:
        for what, value in settings:
            resource.setrlimit(what, value)

    return preexec


def _user_process_count(uid: int) -> int:
    n = 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                n += entry.stat().st_uid == uid
    return n
