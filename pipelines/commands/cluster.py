"""`perpetua cluster render --out DIR [--config FILE] [--json]`: the files to deploy Perpetua on
Kubernetes (Dagster chart values, code-location Dockerfile, manifests of the vLLM servers, MLflow
and the learner Job), rendered from typed configuration (ops.cluster.config) and validated
offline against the `kubernetes` client's models before they are written."""

from __future__ import annotations

from pathlib import Path

from pipelines.cli import UserError, print_json


def add_arguments(p) -> None:
    sub = p.add_subparsers(dest="cluster_command", metavar="ACTION")
    r = sub.add_parser("render", help="write Helm values, Dockerfile and manifests into DIR",
                       description="Write Helm values, Dockerfile and Kubernetes manifests into DIR.")
    r.add_argument("--out", required=True, type=Path, help="directory to write into (created if missing)")
    r.add_argument("--config", type=Path, default=None,
                   help="YAML or JSON file overriding fields of ops.cluster.config.ClusterConfig")
    r.add_argument("--json", action="store_true", help="print the summary (files written, objects validated) as JSON")


def run(args) -> int:
    if getattr(args, "cluster_command", None) != "render":
        raise UserError("say what to do: perpetua cluster render --out DIR [--config FILE]")
    from ops.cluster.config import ClusterConfigError, load_config
    from ops.cluster.render import ManifestError, render, validate_dir, write

    out_dir: Path = args.out
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"--out {out_dir} exists and is not a directory")
    try:
        cfg = load_config(args.config)
        rendered = render(cfg)
    except (ClusterConfigError, ManifestError) as e:
        raise UserError(str(e)) from None
    written = write(rendered, out_dir)
    validated = validate_dir(out_dir)
    summary = {
        "out": str(out_dir.resolve()),
        "files": [str(p.relative_to(out_dir)) for p in written],
        "objects_validated": len(validated),
        "objects": validated,
        "helm_values": "dagster-values.yaml",
        "code_location_env": rendered.env,
        "image": cfg.image.ref,
        "namespace": cfg.namespace,
    }
    if args.json:
        print_json(summary)
    else:
        print(f"wrote {len(written)} files to {summary['out']}; {len(validated)} Kubernetes objects validated")
        print(f"next: kubectl apply -f {out_dir}/k8s/ ; helm install {cfg.release} dagster/dagster "
              f"-n {cfg.namespace} -f {out_dir}/dagster-values.yaml")
    return 0
