"""Where state lives: everything a run writes goes under PERPETUA_HOME (a fixed contract: docs/architecture.md)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Home:
    """The layout of PERPETUA_HOME. Deleting `root` resets the project."""

    root: Path

    @property
    def dagster(self) -> Path:
        return self.root / "dagster"

    @property
    def mlflow(self) -> Path:
        return self.root / "mlflow"

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def models(self) -> Path:
        return self.root / "models"

    @property
    def landing(self) -> Path:
        return self.root / "landing"

    @property
    def quarantine(self) -> Path:
        return self.root / "quarantine"

    def ensure(self) -> "Home":
        for p in (self.dagster, self.mlflow, self.data, self.models, self.landing, self.quarantine):
            p.mkdir(parents=True, exist_ok=True)
        return self


def home() -> Home:
    """The PERPETUA_HOME of this process (default ./.perpetua), as an absolute path."""
    return Home(Path(os.environ.get("PERPETUA_HOME", ".perpetua")).resolve())
