"""Resources per deployment, chosen by PERPETUA_ENV (local by default), as in Dagster's
project_fully_featured: the same assets run against the embedded default or a cluster.

The vLLM engines outlive runs (Dagster starts each run, even each step, in its own process), so
they are supervised server processes (ops/serving/vllm_server.py) and these resources are their
clients: `trainer_server` generates rollouts and evals, `production_server` serves the champion.
"""

import os
from pathlib import Path
from typing import Literal

import dagster as dg


class PolicyServer(dg.ConfigurableResource):
    """A long-lived vLLM OpenAI-compatible server; `engine()` returns a client holding `version`."""

    base_urls: list[str] = []  # empty: the local supervised server on `port`
    port: int = 8001
    kv_cache_gib: float = 1.0
    autostart: bool = True

    def engine(self, model_dir: Path, version: int):
        from ops.rollout.server import ServerEngine

        server = self.warm(model_dir, version)
        engine = ServerEngine(server.url if server else self.base_urls)
        if engine.policy_version != version:
            engine.load_weights(model_dir, version)
        return engine

    def warm(self, model_dir: Path, version: int):
        """The local server, started with `version` if none runs (None for remote servers). The
        demo calls it to overlap a server's start-up with other work; `engine()` goes through it."""
        from ops.rollout.vllm_engine import EngineConfig
        from ops.serving import vllm_server

        if self.base_urls:
            return None
        server = vllm_server.status(self.port)
        if server is None:
            if not self.autostart:
                raise dg.Failure(f"no vLLM server on 127.0.0.1:{self.port} and autostart is off")
            server = vllm_server.start(model_dir, EngineConfig(kv_cache_gib=self.kv_cache_gib), port=self.port,
                                       policy_version=version)
        return server

    def serve(self, model_dir: Path) -> int:
        """Refit the server in place to the policy in `model_dir` and check it now serves it."""
        from ops.rollout.engine import resolve_version

        version = resolve_version(model_dir, None)
        engine = self.engine(Path(model_dir), version)
        if engine.policy_version != version:
            raise RuntimeError(f"server reports policy v{engine.policy_version} after a refit to v{version}")
        return version

    def server_pid(self) -> int | None:
        from ops.serving import vllm_server

        server = None if self.base_urls else vllm_server.status(self.port)
        return server.pid if server else None


class MlflowTracking(dg.ConfigurableResource):
    """Where the MLflow record goes: `tracking_uri` when set, else what
    `ops.common.tracking.tracking_uri` resolves (MLFLOW_TRACKING_URI; the local MLflow server of
    this PERPETUA_HOME when one runs; its SQLite store)."""

    tracking_uri: str = ""
    experiment: str = "perpetua"

    def uri(self) -> str:
        from ops.common import tracking

        return tracking.tracking_uri(self.tracking_uri or None)


class PolicyLineage(dg.ConfigurableResource):
    """Which policy a cycle builds on; the rollouts and the learner ask the same rule.

    `champion` (default): the deployed champion (the base policy until the first deploy) samples
    the cycle's rollouts and the learner continues from its checkpoint, so a candidate the gate
    blocked is set aside, not built on: every candidate is one step from what production serves.
    `latest`: the newest exported policy, blocked or not (training runs on and the gate only
    decides deployment)."""

    continue_from: Literal["champion", "latest"] = "champion"

    def start_version(self, mlflow_uri: str) -> int:
        from ops.deploy import registry
        from ops.policy import versions as policies

        if self.continue_from == "latest":
            return policies.latest_version()
        return registry.champion_policy_version(mlflow_uri, policies.REGISTERED_MODEL)[1]


def for_environment(env: str | None = None) -> dict:
    env = env or os.environ.get("PERPETUA_ENV", "local")
    if env == "local":
        return {
            "pipes_subprocess_client": dg.PipesSubprocessClient(),
            "trainer_server": PolicyServer(port=int(os.environ.get("PERPETUA_TRAINER_PORT", 8001))),
            "production_server": PolicyServer(port=int(os.environ.get("PERPETUA_PRODUCTION_PORT", 8000))),
            "mlflow": MlflowTracking(),
            "lineage": PolicyLineage(),
        }
    if env == "cluster":
        # Engines are remote servers (several behind the round-robin client); MLflow is a server.
        urls = lambda var: [u for u in os.environ.get(var, "").split(",") if u]  # noqa: E731
        return {
            "pipes_subprocess_client": dg.PipesSubprocessClient(),
            "trainer_server": PolicyServer(base_urls=urls("PERPETUA_TRAINER_URLS"), autostart=False),
            "production_server": PolicyServer(base_urls=urls("PERPETUA_PRODUCTION_URLS"), autostart=False),
            "mlflow": MlflowTracking(tracking_uri=os.environ.get("MLFLOW_TRACKING_URI", "")),
            "lineage": PolicyLineage(),
        }
    raise ValueError(f"PERPETUA_ENV must be 'local' or 'cluster', got {env!r}")
