"""`base_policy`: the tiny MoE policy bootstrapped by SFT on the bootstrap families (version 0).

Expensive and deterministic, so it is cached: when a finished bootstrap with the same config
and code version is on disk, the asset reports it again (same data version, so nothing
downstream becomes stale) instead of retraining.
"""


import hashlib
import json

import dagster as dg

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
    code_version=CODE_VERSION,
    automation_condition=dg.AutomationCondition.missing() | dg.AutomationCondition.code_version_changed(),
)
def base_policy(context: dg.AssetExecutionContext, config: BasePolicyConfig) -> dg.MaterializeResult:
    """The base policy: tokenizer + megatron-core MoE trained by SFT until it solves the bootstrap
    families; exported in HF Mixtral format for vLLM. Records success on bootstrap and drift families."""
    cfg = _bootstrap_config(config)
    key = hashlib.sha256((CODE_VERSION + cfg.model_dump_json()).encode()).hexdigest()[:16]
    out = home().models / "base"
    stamp = out / "bootstrap-key.txt"
    if stamp.exists() and stamp.read_text() == key and (out / "hf" / "config.json").exists():
        context.log.info("base policy with this config and code version exists; reusing it")
        result = json.loads((out / "bootstrap.json").read_text())
    else:
        stamp.unlink(missing_ok=True)
        r = bootstrap_base_policy(out, cfg, log=lambda m: context.log.info(f"sft {m}"))
        result = r.sft.to_dict()
        stamp.write_text(key)
    success = result["success"]
    return dg.MaterializeResult(
        metadata={
            "policy_version": 0,
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
