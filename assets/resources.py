"""Resources per deployment, chosen by PERPETUA_ENV (local by default), as in Dagster's
project_fully_featured: the same assets run against the embedded default or a cluster.

The vLLM engines outlive runs (Dagster starts each run, even each step, in its own process), so
they are supervised server processes (ops/serving/vllm_server.py) and these resources are their
clients: `trainer_server` generates rollouts and evals, `production_server` serves the champion.
Each role is a pool of servers (`PolicyServer.replicas` local ones, or the cluster's URLs).
"""

import os
from pathlib import Path
from typing import Literal

import dagster as dg


class PolicyServer(dg.ConfigurableResource):
    """A role's pool of long-lived vLLM OpenAI-compatible servers; `engine()` returns a client of
    the whole pool holding `version`.

    Local (`base_urls` empty): `replicas` supervised servers on ports `port`, `port + 1`, ...,
    `port + replicas - 1`, started together when missing. Cluster: `base_urls`, one URL per
    server (a refit must reach every one, which one load-balanced URL would not do). Requests are
    spread round-robin over the pool; a server that dies is taken out and its requests go to the
    others (ops/rollout/server.py)."""

    base_urls: list[str] = []  # empty: the local supervised servers on `port`, `port + 1`, ...
    port: int = 8001
    replicas: int = 1  # local servers in the pool; a remote pool is its base_urls
    kv_cache_gib: float = 1.0
    autostart: bool = True

    def local_ports(self) -> list[int]:
        """The ports of the local pool's servers; empty for a pool of remote servers."""
        if self.replicas < 1:
            raise ValueError(f"PolicyServer.replicas must be >= 1, got {self.replicas}")
        if self.base_urls:
            if self.replicas != 1:
                raise ValueError(f"PolicyServer.replicas ({self.replicas}) is for local servers; a remote pool is "
                                 f"its base_urls ({len(self.base_urls)} servers)")
            return []
        return [self.port + i for i in range(self.replicas)]

    def urls(self) -> list[str]:
        """Every server of the pool, as base URLs."""
        from ops.serving import vllm_server

        ports = self.local_ports()  # checks the settings, for a remote pool too
        return self.base_urls or [f"http://{vllm_server.DEFAULT_HOST}:{p}" for p in ports]

    def engine(self, model_dir: Path, version: int):
        """A client of the pool refit to `version` (every member, checked by the version it reports).
        Locally, its restart hook starts the pool's dead servers again (refit before they rejoin)."""
        from ops.rollout.server import ServerEngine

        self.warm(model_dir, version)
        restart = (lambda: self.warm(model_dir, version)) if self.local_ports() and self.autostart else None
        engine = ServerEngine(self.urls(), restart=restart)
        if engine.policy_version != version:
            engine.load_weights(model_dir, version)
        else:  # they hold `version` already: a server that rejoins later is refit from here
            engine.weights_dir = Path(model_dir).resolve()
        return engine

    def warm(self, model_dir: Path, version: int) -> list:
        """The local servers, those not running started (together); empty for remote servers.
        With none running they start from `model_dir` labelled `version`; else from the directory
        the running ones were started from, with its own label, so that every server of the pool
        serves one model id (a client refits them all to the version it needs). The demo calls
        it to overlap the start-up with other work; `engine()` goes through it."""
        from concurrent.futures import ThreadPoolExecutor

        from ops.serving import vllm_server
        from ops.serving.api_key import api_key

        ports = self.local_ports()
        running = [vllm_server.status(p) for p in ports]
        if all(running):
            return running
        if not self.autostart:
            missing = [p for p, s in zip(ports, running) if s is None]
            raise dg.Failure(f"no vLLM server on 127.0.0.1 port(s) {missing} and autostart is off")
        up = next((s for s in running if s is not None), None)
        source, label = (Path(up.model_dir), None) if up else (Path(model_dir), version)
        api_key()  # the home's key exists before the servers start together (they all read it)
        with ThreadPoolExecutor(len(ports), thread_name_prefix="vllm-start") as pool:
            return list(pool.map(lambda p, s: s or self._start(p, source, label), ports, running))

    def _start(self, port: int, model_dir: Path, version: int | None):
        from ops.rollout.vllm_engine import EngineConfig
        from ops.serving import vllm_server

        return vllm_server.start(model_dir, EngineConfig(kv_cache_gib=self.kv_cache_gib), port=port,
                                 policy_version=version)

    def serve(self, model_dir: Path) -> int:
        """Refit the pool in place to the policy in `model_dir` and check it now serves it."""
        from ops.rollout.engine import resolve_version

        version = resolve_version(model_dir, None)
        engine = self.engine(Path(model_dir), version)
        if engine.policy_version != version:
            raise RuntimeError(f"servers report policy v{engine.policy_version} after a refit to v{version}")
        return version

    def server_pids(self) -> list[int]:
        """The pids of the local servers running now (each a process group the cost meter follows);
        empty for remote servers."""
        from ops.serving import vllm_server

        running = (vllm_server.status(p) for p in self.local_ports())
        return [s.pid for s in running if s is not None]


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

    `latest` (default): the newest exported policy, blocked or not: training runs on and the gate
    only decides deployment. Learning a new family can pass through a candidate the guard refuses
    (it trades another family or a few guard tasks on the way), and the next cycle's step then
    finishes what that one started instead of starting again (docs/learning.md, "The study settings as
    defaults"). Production still serves only candidates that passed the gate.
    `champion`: the deployed champion (the base policy until the first deploy) samples the
    cycle's rollouts and the learner continues from its checkpoint, so a candidate the gate
    blocked is set aside, not built on: every candidate is one step from what production serves.
    `fall_back_after` k (with `latest`): when the newest policy is the k-th candidate in a row the
    gate blocked as worse than the champion on the deciding set, the cycle builds on the champion
    instead (and so on until a candidate passes), so a candidate that went wrong (a collapse) is
    not compounded without end; a candidate blocked for no gain, or for a guard family it traded
    while learning another, is still built on (0 = never fall back)."""

    continue_from: Literal["champion", "latest"] = "latest"
    fall_back_after: int = 2

    def start_version(self, mlflow_uri: str) -> int:
        from ops.policy import versions as policies

        start = self.learner_start(mlflow_uri)
        return policies.latest_version() if start is None else start

    def falls_back(self) -> bool:
        """With `latest`: the newest policy is the `fall_back_after`-th candidate in a row the gate
        blocked as worse than the champion."""
        from ops.common.paths import home
        from ops.evaluate.report import worse_streak
        from ops.policy import versions as policies

        if self.fall_back_after < 0:
            raise ValueError(f"lineage fall_back_after must be >= 0, got {self.fall_back_after}")
        return bool(self.fall_back_after) and self.continue_from == "latest" and (
            worse_streak(home().data, policies.latest_version()) >= self.fall_back_after)

    def learner_start(self, mlflow_uri: str) -> int | None:
        """The version the learner must start from, or None for its newest checkpoint (the
        `latest` lineage when it does not fall back)."""
        from ops.deploy import registry
        from ops.policy import versions as policies

        if self.continue_from == "latest" and not self.falls_back():
            return None
        return registry.champion_policy_version(mlflow_uri, policies.REGISTERED_MODEL)[1]


def local_pool(role: str, default_port: int) -> PolicyServer:
    """A role's local servers from PERPETUA_<ROLE>_PORT (the first port) and PERPETUA_<ROLE>_REPLICAS."""
    settings = {}
    for field, var, default in (("port", f"PERPETUA_{role}_PORT", default_port), ("replicas", f"PERPETUA_{role}_REPLICAS", 1)):
        value = os.environ.get(var, str(default))
        try:
            settings[field] = int(value)
        except ValueError:
            raise ValueError(f"{var} must be an integer, got {value!r}") from None
    if settings["replicas"] < 1:
        raise ValueError(f"PERPETUA_{role}_REPLICAS must be >= 1, got {settings['replicas']}")
    return PolicyServer(**settings)


def for_environment(env: str | None = None) -> dict:
    env = env or os.environ.get("PERPETUA_ENV", "local")
    if env == "local":
        trainer, production = local_pool("TRAINER", 8001), local_pool("PRODUCTION", 8000)
        if shared := sorted(set(trainer.local_ports()) & set(production.local_ports())):
            raise ValueError(
                f"the trainer servers (ports {trainer.local_ports()}) and the production servers (ports "
                f"{production.local_ports()}) would share port(s) {shared}: each role's servers take PORT, PORT+1, ... "
                "up to its REPLICAS; move one role's PERPETUA_*_PORT past the other's range"
            )
        return {
            "pipes_subprocess_client": dg.PipesSubprocessClient(),
            "trainer_server": trainer,
            "production_server": production,
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
