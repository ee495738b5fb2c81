"""`base_policy`: the tiny MoE policy bootstrapped by SFT on the bootstrap families (version 0).

Expensive and deterministic, so it is cached: when a finished bootstrap with the same config
and code version is on disk, the asset reports it again (same data version, so nothing
downstream becomes stale) instead of retraining.
"""


import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING

import dagster as dg

from ops.common.atomic import atomic_write_text
from ops.envs import Environment
from ops.envs.home import CALCULATOR_V1, bind_environment, home_environment, stage_code_version
from ops.common.paths import home

if TYPE_CHECKING:  # imported where used: ops.policy.bootstrap loads torch and megatron-core
    from ops.policy.bootstrap import BootstrapConfig

CODE_VERSION = "base_policy-v1"
KEY_FILE = "bootstrap-key.txt"  # the cache key the base policy on disk was trained under
CONFIG_FILE = "bootstrap-config.json"  # the asset config it was trained with (to reuse it elsewhere)


class BasePolicyConfig(dg.Config):
    preset: str = "tiny"
    max_steps: int = 1200
    target_success: float = 0.95
    threads: int = 0


def bootstrap_config(config: BasePolicyConfig) -> "BootstrapConfig":
    from ops.policy.bootstrap import BootstrapConfig

    cfg = BootstrapConfig(preset=config.preset, threads=config.threads)
    return cfg.model_copy(update={"sft": cfg.sft.model_copy(update={"max_steps": config.max_steps,
                                                                      "target_success": config.target_success})})


def bootstrap_key(config: BasePolicyConfig, env: Environment) -> str:
    """The cache key of a base policy: the code version, the bootstrap config and, for any world
    but the calculator (whose key is the one it always had), the environment's code version."""
    env_part = "" if env.identity() == CALCULATOR_V1 else env.code_version()
    return hashlib.sha256((CODE_VERSION + bootstrap_config(config).model_dump_json() + env_part).encode()).hexdigest()[:16]


def record_key(out: Path, config: BasePolicyConfig, env: Environment) -> str:
    """Stamp the base policy in `out` with the key and the config it was trained under, so that
    the bootstrap reuses it, here or in a home it is copied into (reuse_run_config)."""
    key = bootstrap_key(config, env)
    (out / KEY_FILE).write_text(key)
    atomic_write_text(out / CONFIG_FILE, json.dumps(config.model_dump(), sort_keys=True) + "\n")
    return key


def reuse_run_config(base_dir: Path, env: Environment) -> dict:
    """The `bootstrap` job's run config under which `base_policy` reuses the base policy in
    `base_dir` (a home's models/base, copied into another home) instead of training a new one:
    the config recorded with it (the defaults for a base trained before configs were recorded).
    Raises ValueError when the directory is no base policy or was trained under another key."""
    key_file, config_file = base_dir / KEY_FILE, base_dir / CONFIG_FILE
    if not (base_dir / "hf" / "config.json").exists() or not key_file.exists():
        raise ValueError(f"{base_dir}: not a finished base policy (no hf/config.json or {KEY_FILE}; use a home's models/base)")
    config = BasePolicyConfig(**json.loads(config_file.read_text())) if config_file.exists() else BasePolicyConfig()
    if key_file.read_text() != bootstrap_key(config, env):
        raise ValueError(f"{base_dir}: trained under another base_policy config or code version than "
                         f"{'its ' + CONFIG_FILE if config_file.exists() else 'the defaults (it records no ' + CONFIG_FILE + ')'}; "
                         "the demo would train a new base policy instead of reusing it")
    return {"ops": {"base_policy": {"config": config.model_dump()}}} if config_file.exists() else {}


@dg.asset(
    group_name="bootstrap",
    kinds={"megatron", "pytorch"},
    code_version=stage_code_version(CODE_VERSION),
    automation_condition=dg.AutomationCondition.missing() | dg.AutomationCondition.code_version_changed(),
)
def base_policy(context: dg.AssetExecutionContext, config: BasePolicyConfig) -> dg.MaterializeResult:
    """The base policy of the home's environment (ops/envs/home.py): tokenizer + megatron-core MoE
    trained by SFT until it solves the bootstrap families; exported in HF Mixtral format for vLLM.
    Records success on bootstrap and drift families, and binds the home to the environment."""
    cfg = bootstrap_config(config)
    env = home_environment()
    key = bootstrap_key(config, env)
    out = home().models / "base"
    stamp = out / KEY_FILE
    if stamp.exists() and stamp.read_text() == key and (out / "hf" / "config.json").exists():
        context.log.info("base policy with this config and code version exists; reusing it")
        result = json.loads((out / "bootstrap.json").read_text())
    else:
        stamp.unlink(missing_ok=True)
        from ops.policy.bootstrap import bootstrap_base_policy

        r = bootstrap_base_policy(out, cfg, log=lambda m: context.log.info(f"sft {m}"), env=env)
        result = r.sft.to_dict()
    record_key(out, config, env)
    bind_environment(env)
    success = result["success"]
    return dg.MaterializeResult(
        metadata={
            "policy_version": 0,
            "environment": dg.MetadataValue.json(env.identity()),
            "hf_dir": dg.MetadataValue.path(str(out / "hf")),
            "bootstrap_success": dg.MetadataValue.float(result["bootstrap_success"]),
            "drift_success": dg.MetadataValue.float(result["drift_success"]),
            "success_by_family": dg.MetadataValue.json(success),
            "sft_steps": result["steps"],
            "sft_seconds": dg.MetadataValue.float(result["seconds"]),
            "preset": cfg.preset,
        },
        data_version=dg.DataVersion(key),
    )
