"""`base_policy`: the tiny MoE policy bootstrapped by SFT on the bootstrap families (version 0).

Expensive and deterministic, so it is cached: when a finished bootstrap with the same config
and code version is on disk, the asset reports it again (same data version, so nothing
downstream becomes stale) instead of retraining.
"""


import hashlib
import json

import dagster as dg

from ops.envs.home import CALCULATOR_V1, bind_environment, home_environment, stage_code_version
from ops.policy.bootstrap import BootstrapConfig, bootstrap_base_policy
from ops.common.paths import home

CODE_VERSION = "base_policy-v1"


class BasePolicyConfig(dg.Config):
    preset: str = "tiny"
    max_steps: int = 1200
    target_success: float = 0.95
    threads: int = 0


def _bootstrap_config(config: BasePolicyConfig) -> BootstrapConfig:
    cfg = BootstrapConfig(preset=config.preset, threads=config.threads)
    return cfg.model_copy(update={"sft": cfg.sft.model_copy(update={"max_steps": config.max_steps,
                                                                      "target_success": config.target_success})})


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
    cfg = _bootstrap_config(config)
    env = home_environment()
    # the calculator world's key is the one it always had, so an existing base policy is reused
    env_part = "" if env.identity() == CALCULATOR_V1 else env.code_version()
    key = hashlib.sha256((CODE_VERSION + cfg.model_dump_json() + env_part).encode()).hexdigest()[:16]
    out = home().models / "base"
    stamp = out / "bootstrap-key.txt"
    if stamp.exists() and stamp.read_text() == key and (out / "hf" / "config.json").exists():
        context.log.info("base policy with this config and code version exists; reusing it")
        result = json.loads((out / "bootstrap.json").read_text())
    else:
        stamp.unlink(missing_ok=True)
        r = bootstrap_base_policy(out, cfg, log=lambda m: context.log.info(f"sft {m}"), env=env)
        result = r.sft.to_dict()
        stamp.write_text(key)
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
