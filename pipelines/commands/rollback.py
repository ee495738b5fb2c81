"""`perpetua rollback [--json]`: the previous champion becomes champion again and is served.

The production server is refit first and the aliases swap only after it serves the old
champion, so a failed rollback leaves everything as it was (ops/deploy/deploy.py)."""

from __future__ import annotations


from pipelines.cli import UserError, print_json


def add_arguments(p) -> None:
    p.add_argument("--json", action="store_true", help="print the result as JSON")


def run(args) -> int:
    from ops.deploy.deploy import rollback_policy
    from ops.deploy.registry import DeployError, RegistryError
    from assets.resources import for_environment

    resources = for_environment()
    try:
        deployed = rollback_policy(resources["mlflow"].uri(), resources["production_server"].serve)
    except (RegistryError, DeployError) as e:
        raise UserError(str(e)) from None
    result = {"champion": deployed.registry_version, "previous_champion": deployed.previous,
              "served_policy_version": deployed.policy_version}
    if args.json:
        print_json(result)
    else:
        print(f"champion is now registry v{deployed.registry_version} (policy v{deployed.policy_version}), "
              f"previous-champion v{deployed.previous}")
    return 0
