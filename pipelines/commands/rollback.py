"""`perpetua rollback [--json]`: the previous champion becomes champion again and is served.

The production server is refit first and the aliases swap only after it serves the old
champion, so a failed rollback leaves everything as it was (ops/deploy/registry.py)."""

from __future__ import annotations


from pipelines.cli import UserError, print_json


def add_arguments(p) -> None:
    p.add_argument("--json", action="store_true", help="print the result as JSON")


def run(args) -> int:
    from ops.policy import versions as policies
    from ops.deploy import registry
    from assets.resources import for_environment

    resources = for_environment()
    uri, production = resources["mlflow"].uri(), resources["production_server"]
    served = {}

    def refit(version: str, local_dir: str) -> None:
        served["policy_version"] = production.serve(local_dir)

    try:
        state = registry.rollback(uri, policies.REGISTERED_MODEL, refit=refit)
    except registry.RegistryError as e:
        raise UserError(str(e)) from None
    from assets.deployment import write_champion_pointer

    write_champion_pointer(state.champion, served["policy_version"])
    result = {"champion": state.champion, "previous_champion": state.previous,
              "served_policy_version": served["policy_version"]}
    if args.json:
        print_json(result)
    else:
        print(f"champion is now registry v{state.champion} (policy v{served['policy_version']}), "
              f"previous-champion v{state.previous}")
    return 0
