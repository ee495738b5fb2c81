"""The base policy (version 0): tokenizer, megatron MoE model, bootstrap SFT, checkpoint and HF
export. `base_policy` (the asset) is this function plus metadata.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Callable

import torch
from pydantic import BaseModel, Field

from ops.envs import Environment, get_environment
from ops.policy import checkpoint

from ops.policy import hf_convert

from ops.policy import tokenizer as tok_lib
from ops.policy.model import PRESETS, build_model, init_single_process
from ops.policy.sft import SFTConfig, SFTResult, train_sft


class BootstrapConfig(BaseModel):
    """How the base policy is made."""

    preset: Annotated[str, Field(description="Architecture preset (ops.policy.model.PRESETS)")] = "tiny"
    sft: Annotated[SFTConfig, Field(description="Bootstrap fine-tuning settings")] = SFTConfig()
    seed: Annotated[int, Field(description="Model initialisation seed")] = 0
    threads: Annotated[int, Field(ge=0, description="torch CPU threads (0 = torch default)")] = 0


@dataclass
class BootstrapResult:
    hf_dir: Path
    checkpoint_dir: Path
    sft: SFTResult
    num_parameters: int


def bootstrap_base_policy(out_dir: Path, cfg: BootstrapConfig, log: Callable[[dict], None] = lambda m: None,
                          env: Environment | None = None) -> BootstrapResult:
    """Train the base policy of environment `env` (the calculator world by default) from scratch into
    `out_dir` (hf/ and checkpoint/ inside): its tokenizer on the environment's text, SFT on its
    bootstrap families."""
    env = env or get_environment()
    if cfg.preset not in PRESETS:
        raise ValueError(f"unknown preset {cfg.preset!r}; choose one of {sorted(PRESETS)}")
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    pcfg = PRESETS[cfg.preset]
    out_dir = Path(out_dir)
    tok_dir = out_dir / "tokenizer"
    tok_lib.save_hf_tokenizer(tok_lib.train_tokenizer(pcfg.vocab_size, seed=cfg.seed, env=env), tok_dir,
                              model_max_length=pcfg.max_position_embeddings)
    tokenizer = tok_lib.load_hf_tokenizer(tok_dir)

    init_single_process(cfg.seed)
    model = build_model(pcfg, seed=cfg.seed)
    result = train_sft(model, tokenizer, cfg.sft, log=log, env=env)

    sd = checkpoint.global_state_dict(model, pcfg.num_experts)
    # v0 is rebuilt in place when its config or code changes: the new one replaces the old
    ckpt = checkpoint.save(out_dir / "checkpoint", 0, sd, meta={"policy_version": 0, "preset": pcfg.name,
                                                               "policy_config": pcfg.model_dump()}, replace=True)
    hf_dir = hf_convert.export_hf(pcfg, sd, out_dir / "hf", tokenizer, replace=True,
                                  extra={"perpetua_policy_version": 0, "perpetua_environment": env.identity()})
    (out_dir / "bootstrap.json").write_text(json.dumps(result.to_dict(), indent=2))
    return BootstrapResult(hf_dir, ckpt, result, pcfg.num_parameters)


def random_policy(out_dir: Path, seed: int = 1234, preset: str = "tiny", version: int | None = 0,
                  env: Environment | None = None) -> Path:
    """An untrained policy of `preset`, exported like every policy is (tokenizer/ and hf/ in
    `out_dir`, the tokenizer trained on `env`'s text): for parity checks, benchmarks and tests.
    `version` goes into config.json as `perpetua_policy_version` (None leaves it out)."""
    pcfg = PRESETS[preset]
    out_dir = Path(out_dir)
    tok_lib.save_hf_tokenizer(tok_lib.train_tokenizer(pcfg.vocab_size, env=env), out_dir / "tokenizer")
    tokenizer = tok_lib.load_hf_tokenizer(out_dir / "tokenizer")
    init_single_process()
    model = build_model(pcfg, seed=seed)
    extra = None if version is None else {"perpetua_policy_version": version}
    return hf_convert.export_hf(pcfg, checkpoint.global_state_dict(model, pcfg.num_experts), out_dir / "hf", tokenizer,
                                extra=extra, replace=True)
