"""`perpetua stop [--json]`: stop the long-lived local services of this PERPETUA_HOME.

The vLLM servers, the persistent learner (ops/learn/service.py), the MLflow server, a Dagster
daemon a demo left behind (pipelines/daemon.py) and, for a home on PostgreSQL, its PostgreSQL
server outlive
the commands and Dagster runs that start them (engines stay up across iterations, by design). The
demo stops the vLLM and MLflow servers it started; servers that runs launched by the daemon
started, and the PostgreSQL server (the instance's storage, which the daemon and the webserver
need), keep running until this command (or `make clean`, which runs it before deleting
PERPETUA_HOME) ends them. Stale pid files are removed on the way.
"""

from __future__ import annotations

from pipelines.cli import print_json


def add_arguments(p) -> None:
    p.add_argument("--json", action="store_true",
                   help='print {"vllm": [ports stopped], "learner": bool, "mlflow": bool, "dagster_daemon": bool, "postgres": bool} as JSON')


def run(args) -> int:
    from ops.common.paths import home
    from ops.learn import service as learner_service
    from ops.serving import mlflow_server
    from ops.serving import postgres_server
    from ops.serving import vllm_server
    from pipelines import daemon

    h = home()
    stopped = {"vllm": [port for port in vllm_server.recorded_ports(h) if vllm_server.stop(port, h)],
               "learner": learner_service.stop(h), "mlflow": mlflow_server.stop(h), "dagster_daemon": daemon.stop(h)}
    stopped["postgres"] = postgres_server.stop(h)  # last: the MLflow server was one of its clients
    if args.json:
        print_json(stopped)
    else:
        what = [f"vLLM server on port {port}" for port in stopped["vllm"]] + (["learner service"] if stopped["learner"] else []) \
            + (["MLflow server"] if stopped["mlflow"] else []) \
            + (["Dagster daemon"] if stopped["dagster_daemon"] else []) \
            + (["PostgreSQL server"] if stopped["postgres"] else [])
        print(f"stopped {', '.join(what)}" if what else f"nothing was running for PERPETUA_HOME={h.root}")
    return 0
