"""`perpetua envs [--json]`: the registered environments (built in, and from packages through the
`perpetua.environments` entry-point group; ops/envs/__init__.py)."""

from __future__ import annotations

from pipelines.cli import print_json


def add_arguments(p) -> None:
    p.add_argument("--json", action="store_true",
                   help='print [{"name", "version", "description", "demo"}] (demo: `perpetua demo --env NAME` runs on it)')


def run(args) -> int:
    from ops.envs import describe_environments
    from ops.envs.home import recorded_environment

    envs = describe_environments()
    if args.json:
        print_json(envs)
        return 0
    recorded = recorded_environment()
    for e in envs:
        mark = "  (this home)" if recorded and recorded["name"] == e["name"] else ""
        demo = "demo" if e["demo"] else "    "
        print(f"{e['name']:<16} v{e['version']:<4} {demo}  {e['description']}{mark}")
    return 0
