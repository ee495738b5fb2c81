"""`perpetua simulate [--requests N] [--duration S] [--traces landing|mlflow] [--json]`:
production traffic against the served champion; traces go to PERPETUA_HOME/landing/, or with
`--traces mlflow` to MLflow traces in the project's experiment (ops.harvest.simulator).

The champion is served by the local vLLM server (ops.serving.vllm_server, reused when one is
healthy). Which weights: `--model-dir DIR`, else the registry's `champion` alias (MLflow at
MLFLOW_TRACKING_URI, the running local MLflow server, or PERPETUA_HOME/mlflow/mlflow.db;
model `--model-name`), else whatever the running server holds. The server is refit to the
chosen weights when it serves another version, and left running for the next command unless
`--stop-server`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pipelines.cli import UserError, print_json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ops.common.tracking import REGISTERED_MODEL

    parser.add_argument("--requests", type=int, default=None, help="Requests to send (default 64; with --duration: no cap).")
    parser.add_argument("--duration", type=float, default=None, metavar="S", help="Run for S seconds; traffic drifts over them.")
    parser.add_argument("--json", action="store_true", help="Print the result as JSON.")
    parser.add_argument("--model-dir", default=None, help="HF policy dir to serve (default: the registry champion).")
    parser.add_argument("--model-name", default=REGISTERED_MODEL, help="Registered model whose champion is served.")
    parser.add_argument("--model-version", default=None, help="model_version written in traces (default: registry version or policy version).")
    parser.add_argument("--port", type=int, default=8000, help="Port of the local vLLM server (127.0.0.1).")
    parser.add_argument("--wave-size", type=int, default=16, help="Concurrent requests per wave.")
    parser.add_argument("--seed", type=int, default=0, help="Traffic seed.")
    parser.add_argument("--temperature", type=float, default=0.0, help="Serving temperature.")
    parser.add_argument("--traces", choices=("landing", "mlflow"), default="landing",
                        help="Where traces go: files in PERPETUA_HOME/landing (default) or MLflow traces in --experiment.")
    parser.add_argument("--experiment", default="perpetua", help="MLflow experiment of the traces (with --traces mlflow).")
    parser.add_argument("--stop-server", action="store_true", help="Stop the vLLM server afterwards.")


def champion(h, model_name: str) -> tuple[Path, str] | None:
    """(local model dir, registry version) of the champion, or None when there is none to find."""
    from ops.common.tracking import TrackingError, existing_tracking_uri
    from ops.deploy import registry

    try:
        uri = existing_tracking_uri(h=h)
    except TrackingError as e:
        raise UserError(str(e)) from None
    if uri is None:
        return None
    try:
        version = registry.champion_version(uri, model_name)
    except registry.RegistryError:
        return None
    if version is None:
        return None
    return registry.model_dir(uri, model_name, version, dst=h.models / "served" / f"{model_name}-v{version}"), version


def mlflow_sink(h, experiment: str, model_name: str, registry_version: str | None):
    """MLflow traces in `experiment` of this home's store, linked to the served version's LoggedModel when known."""
    from ops.common.tracking import TrackingError, tracking_uri
    from ops.deploy import registry
    from ops.harvest.mlflow_sink import MlflowTraceSink

    try:
        uri = tracking_uri(h=h)
    except TrackingError as e:
        raise UserError(str(e)) from None
    model_id = registry.version_model_id(uri, model_name, registry_version) if registry_version else None
    return MlflowTraceSink(tracking_uri=uri, experiment=experiment, model_id=model_id)


def run(args: argparse.Namespace) -> int:
    from ops.policy import tokenizer as tok_lib
    from ops.common.paths import home
    from ops.rollout.engine import RolloutEngineError, read_policy_version
    from ops.rollout.server import ServerEngine
    from ops.envs.home import home_environment
    from ops.harvest.simulator import SimulatorConfig, format_report, run_simulation
    from ops.serving import vllm_server

    if args.requests is not None and args.requests < 1:
        raise UserError("--requests must be at least 1")
    if args.duration is not None and args.duration <= 0:
        raise UserError("--duration must be positive")
    if args.wave_size < 1:
        raise UserError("--wave-size must be at least 1")
    h = home().ensure()
    trace_version = args.model_version
    registry_version = None
    if args.model_dir is not None:
        model_dir = Path(args.model_dir).resolve()
        if not (model_dir / "config.json").exists():
            raise UserError(f"--model-dir {model_dir} is not an HF model directory (no config.json)")
    elif (found := champion(h, args.model_name)) is not None:
        model_dir, registry_version = found
        trace_version = trace_version or registry_version
    elif (running := vllm_server.status(args.port, h)) is not None:
        model_dir = Path(running.model_dir)
    else:
        raise UserError(
            f"no champion to serve: no `champion` alias on {args.model_name!r} in the registry and no vLLM server "
            f"on port {args.port}; pass --model-dir DIR (or run `perpetua demo` first)"
        )

    cfg = SimulatorConfig(
        requests=args.requests if args.requests is not None else (None if args.duration else 64),
        duration_s=args.duration, wave_size=args.wave_size, seed=args.seed, temperature=args.temperature,
        model_version=trace_version,
    )  # fmt: skip
    traces_to = h.landing if args.traces == "landing" else mlflow_sink(h, args.experiment, args.model_name, registry_version)
    try:
        server = vllm_server.start(model_dir, port=args.port, h=h)
    except vllm_server.VllmServerError as e:
        raise UserError(str(e)) from None
    log = (lambda line: None) if args.json else (lambda line: print(line, file=sys.stderr))
    try:
        with ServerEngine([server.url]) as engine:
            want = read_policy_version(model_dir)
            if want is not None and engine.policy_version != want:
                info = engine.load_weights(model_dir, want)
                log(f"refit the server to policy version {want} in {info.seconds:.2f} s")
            tokenizer = tok_lib.load_hf_tokenizer(model_dir)
            result = run_simulation(engine, tokenizer, traces_to, cfg, env=home_environment(), log=log)
    except RolloutEngineError as e:
        raise UserError(f"simulation failed: {e}") from None
    finally:
        if args.stop_server:
            vllm_server.stop(args.port, h)
    out = result.to_dict() | {"server_url": server.url, "model_dir": str(model_dir), "server_reused": server.reused}
    if args.json:
        print_json(out)
    else:
        where = h.landing if args.traces == "landing" else f"MLflow experiment {args.experiment!r} ({traces_to.tracking_uri})"
        print(f"{out['requests']} requests in {out['seconds']:.1f} s against {server.url} (model version {result.model_version}); "
              f"outcomes {out['outcomes']}; traces in {where}")
        print("failure rate by family over production time (requests):")
        print(format_report(result))
    return 0
