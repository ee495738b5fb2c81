"""GPU check: megatron-core's native CUDA path of the learner, on one machine, in minutes.

`make gpu-check` (or `python -m ops.gpu_check` from the repository root) prints one JSON object:

- `import_chain`: the modules used here load neither Dagster, MLflow nor vLLM (the GPU machines
  have none of them): their import is blocked for the whole check, so a dependency fails its part;
- `learner_step`: one `ops.learn.step.Learner` step on the tiny preset with a random verified
  batch: bf16, megatron's optimizer, NCCL and Transformer Engine where installed on CUDA; fp32,
  torch AdamW over `main_grad` and gloo on CPU;
- `learner_job`: the learner process itself (`ops.learn.main` under `torchrun`, as a cycle runs
  it), twice: step 1 from an HF policy, step 2 resumed from step 1's checkpoint (model, optimizer,
  RNG, counters); both export the next policy in HF format;
- `distributed_optimizer`: one update through megatron's distributed optimizer (DDP with
  `use_distributed_optimizer`), CUDA only;
- `parity`: per-token log-probs of the stepped weights in megatron-core and transformers on the
  same device (bf16 tolerance on CUDA, the fp32 one of `perpetua parity` on CPU);
- `bench`: `ops.bench.learner` on the GPU (skipped on CPU: `perpetua bench learner` covers it);
- `vllm`: not tested here (the CUDA vLLM wheel cannot travel to the GPU machine).

On a machine without CUDA it is a dry run of the CPU-safe parts with `"cuda": false` and the same
keys. Missing packages (megatron-core, transformers, ...) are installed without an index from the
wheel folder named by `PERPETUA_WHEELS` (README, "Running on a GPU cluster"). Exit code 0 when
every part that ran passed, 1 otherwise, 2 for a setup mistake.
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

# Top-level packages the GPU path must not load: the GPU machines do not have them.
FORBIDDEN = ("dagster", "dagster_pipes", "mlflow", "vllm")
# (import name, requirement) of what this check needs besides torch.
REQUIRED = (
    ("megatron.core", "megatron-core"),
    ("transformers", "transformers"),
    ("safetensors", "safetensors"),
    ("pyarrow", "pyarrow"),
    ("pydantic", "pydantic"),
    ("numpy", "numpy"),
)
PARITY_TOLERANCE = {"fp32": 1e-3, "bf16": 0.1}
VLLM_NOT_TESTED = ("vLLM's CUDA path is not tested here: the CUDA vLLM wheel cannot travel to the GPU machine "
                   "(no package index there); the CPU vLLM path is covered by `perpetua parity` and the tests")


class SetupError(Exception):
    """The machine lacks something the check needs and cannot be given it: one line, exit 2."""


def _missing() -> list[str]:
    missing = []
    for module, requirement in REQUIRED:
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            missing.append(requirement)
    return missing


def ensure_packages() -> list[str]:
    """Install what is missing from the wheel folder `PERPETUA_WHEELS`, with no index."""
    if importlib.util.find_spec("torch") is None:
        raise SetupError(f"torch is not installed for {sys.executable}; the check runs on the machine's own torch")
    missing = _missing()
    if not missing:
        return []
    wheels = os.environ.get("PERPETUA_WHEELS")
    if not wheels:
        raise SetupError(f"missing {', '.join(missing)}; set PERPETUA_WHEELS to a folder of wheels "
                         "(pip download --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 "
                         f"{' '.join(missing)} -d wheels/)")
    if not Path(wheels).is_dir():
        raise SetupError(f"PERPETUA_WHEELS={wheels} is not a folder")
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                           "--no-index", "--find-links", wheels, *missing], capture_output=True, text=True)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise SetupError(f"installing {', '.join(missing)} from {wheels} failed: {last}")
    importlib.invalidate_caches()
    still = _missing()
    if still:
        raise SetupError(f"{', '.join(still)} still not importable after installing from {wheels}")
    return missing


def block_forbidden() -> None:
    """Make importing Dagster, MLflow or vLLM fail here as it does on the GPU machines, so a
    dependency on them shows on any machine (None in sys.modules halts an import)."""
    for name in FORBIDDEN:
        if name not in sys.modules:
            sys.modules[name] = None  # type: ignore[assignment]


def forbidden_loaded() -> list[str]:
    return sorted(name for name in FORBIDDEN if sys.modules.get(name) is not None)


def _part(fn, *args, **kwargs) -> dict:
    """Run one part; a failure becomes {"ok": false, "error": ...} so the other parts still run."""
    t0 = time.perf_counter()
    try:
        out = fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - reported in the JSON, the check goes on
        out = {"ok": False, "error": f"{type(e).__name__}: {e}",
               "traceback": traceback.format_exc(limit=6).splitlines()[-6:]}
    out["seconds"] = round(time.perf_counter() - t0, 2)
    return out


def _batch(policy, cfg, groups: int, group_size: int, seed: int):
    from ops.bench.learner import _random_tables
    from ops.learn.batch import build_training_batch

    rollouts, rewards = _random_tables(groups, group_size, policy.vocab_size, seed)
    return build_training_batch(rollouts, rewards, cfg.advantage)


def learner_step(cuda: bool, seed: int = 0) -> tuple[dict, object]:
    """One learner step on the tiny preset; returns the part's report and the Learner."""
    import math

    import torch
    import torch.distributed as dist

    from ops.learn.config import LearnerConfig
    from ops.learn.step import Learner
    from ops.policy.model import PRESETS

    policy = PRESETS["tiny"]
    precision = "bf16" if cuda else "fp32"
    cfg = LearnerConfig(lr=1e-4, micro_batch_size=8, precision=precision, seed=seed)
    batch = _batch(policy, cfg, groups=4, group_size=4, seed=seed)
    learner = Learner(policy, cfg)
    before = {k: v.detach().float().clone() for k, v in learner.state_dict().items()}
    step = learner.train_step(batch)
    after = learner.state_dict()
    changed = sum(1 for k, v in after.items() if not torch.equal(before[k], v.detach().float()))
    m = step.last
    ok = bool(step.updates) and math.isfinite(m.get("loss", math.nan)) and math.isfinite(m.get("grad_norm", math.nan)) \
        and changed > 0
    return {
        "ok": ok,
        "preset": policy.name,
        "precision": precision,
        "optimizer": type(learner.optimizer).__name__,
        "backend": dist.get_backend() if dist.is_initialized() else None,
        "layer_spec": _spec_name(learner.gpt),
        "samples": len(batch),
        "tokens": batch.stats.tokens,
        "loss": m.get("loss"),
        "grad_norm": m.get("grad_norm"),
        "tensors_changed": changed,
        "tensors": len(after),
    }, learner


def learner_job(cuda: bool, seed: int = 0) -> dict:
    """`ops.learn.main` under torchrun, two steps in a scratch folder: v0 (HF) -> v1 -> v2."""
    from ops.bench.learner import _random_tables
    from ops.common.tables import REWARDS, ROLLOUTS, write_table
    from ops.learn.config import LearnerConfig, LearnerJob
    from ops.learn.launch import LocalTorchrun, launch_pythonpath
    from ops.policy import hf_convert
    from ops.policy.model import PRESETS, build_model

    policy = PRESETS["tiny"]
    precision = "bf16" if cuda else "fp32"
    steps = []
    with tempfile.TemporaryDirectory(prefix="perpetua-gpu-check-") as tmp:
        root = Path(tmp)
        init = hf_convert.export_hf(policy, build_model(policy, precision, seed=seed).state_dict(), root / "base" / "hf")
        for step in (1, 2):
            rollouts, rewards = _random_tables(4, 4, policy.vocab_size, seed + step)
            write_table(rollouts, ROLLOUTS, root / f"rollouts-{step}.parquet")
            write_table(rewards, REWARDS, root / f"rewards-{step}.parquet")
            job = LearnerJob(learner=LearnerConfig(lr=1e-4, precision=precision, seed=seed),
                             rollouts=[root / f"rollouts-{step}.parquet"], rewards=[root / f"rewards-{step}.parquet"],
                             init_hf_dir=init, checkpoint_dir=root / "learner", export_root=root / "policy",
                             result_path=root / f"result-{step}.json")
            (root / f"job-{step}.json").write_text(job.model_dump_json())
            env = {k: v for k, v in os.environ.items() if not k.startswith("DAGSTER_PIPES")}
            env["PYTHONPATH"] = launch_pythonpath()
            t0 = time.perf_counter()
            proc = subprocess.run(LocalTorchrun().command(root / f"job-{step}.json"), env=env, capture_output=True, text=True,
                                  timeout=300)
            if proc.returncode != 0:
                tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-8:]
                return {"ok": False, "error": f"step {step}: exit {proc.returncode}", "stderr_tail": tail, "steps": steps}
            result = json.loads((root / f"result-{step}.json").read_text())
            steps.append({"version_in": result.get("parent_policy_version"), "version_out": result.get("policy_version"),
                          "exported": (root / "policy" / f"v{step:04d}" / "hf" / "config.json").exists(),
                          "seconds": round(time.perf_counter() - t0, 2)})
    ok = [(s["version_in"], s["version_out"], s["exported"]) for s in steps] == [(0, 1, True), (1, 2, True)]
    return {"ok": ok, "precision": precision, "launcher": "torchrun --standalone --nproc_per_node 1", "steps": steps}


def _spec_name(gpt) -> str:
    names = {type(m).__module__.split(".")[0] for m in gpt.modules()}
    return "transformer_engine" if "transformer_engine" in names else "local"


def distributed_optimizer_step(seed: int = 0) -> dict:
    """One bf16 update through megatron's DistributedOptimizer (CUDA only)."""
    import math

    import torch
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    from ops.learn.config import LearnerConfig
    from ops.learn.micro_batches import plan_micro_batches
    from ops.policy.model import PRESETS, build_model

    policy = PRESETS["tiny"]
    gpt = build_model(policy, "bf16", seed=seed)
    ddp = DistributedDataParallel(gpt.config, DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=True),
        Float16Module(gpt.config, gpt))
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-4, bf16=True, params_dtype=torch.bfloat16,
                                                 use_distributed_optimizer=True, clip_grad=1.0), [ddp])
    batch = _batch(policy, LearnerConfig(), groups=2, group_size=4, seed=seed)
    before = {k: v.detach().float().clone() for k, v in gpt.state_dict().items() if not k.endswith("_extra_state")}
    ddp.zero_grad_buffer()
    opt.zero_grad()
    for mb in plan_micro_batches(batch.samples, 8, 1, 0, 0):
        mb = mb.to(torch.device("cuda"))
        positions = torch.arange(mb.tokens.shape[1], device=mb.tokens.device).unsqueeze(0).expand_as(mb.tokens)
        logits = ddp(mb.tokens, positions, attention_mask=None, padding_mask=mb.padding).float()
        logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, mb.tokens[:, 1:, None]).squeeze(-1)
        (-(mb.advantages[:, None] * logp * mb.target_mask).sum() / mb.target_mask.sum().clamp(min=1)).backward()
    ddp.finish_grad_sync()
    ok, grad_norm, _ = opt.step()
    changed = sum(1 for k, v in gpt.state_dict().items() if k in before and not torch.equal(before[k], v.detach().float()))
    grad_norm = float(grad_norm) if grad_norm is not None else math.nan
    return {"ok": bool(ok) and math.isfinite(grad_norm) and changed > 0, "optimizer": type(opt).__name__,
            "grad_norm": grad_norm, "tensors_changed": changed}


def parity(learner, cuda: bool, seed: int = 0) -> dict:
    """Log-probs of the learner's current weights in megatron-core and in transformers."""
    import torch
    from transformers import MixtralForCausalLM

    from ops.policy import checkpoint, hf_convert
    from ops.policy.model import build_model, token_logprobs

    precision = "bf16" if cuda else "fp32"
    dtype = torch.bfloat16 if cuda else torch.float32
    device = torch.device("cuda" if cuda else "cpu")
    policy = learner.policy
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(4, policy.vocab_size, (1, n), generator=gen) for n in (17, 33, 48, 64)]
    with tempfile.TemporaryDirectory(prefix="perpetua-gpu-check-") as tmp:
        hf_dir = hf_convert.export_hf(policy, learner.state_dict(), Path(tmp) / "hf")
        cfg, sd = hf_convert.import_hf(hf_dir)
        mega = build_model(cfg, precision, seed=seed)
        checkpoint.load_global_state_dict(mega, sd, cfg.num_experts)
        mega.eval()
        hf = MixtralForCausalLM.from_pretrained(str(hf_dir), dtype=dtype).to(device).eval()
        diffs = []
        with torch.no_grad():
            for ids in prompts:
                ids = ids.to(device)
                a = token_logprobs(mega, ids)[0].float()
                logits = hf(ids).logits.float()
                b = torch.log_softmax(logits[0, :-1], -1).gather(-1, ids[0, 1:, None]).squeeze(-1)
                diffs.append((a - b).abs())
    everything = torch.cat(diffs)
    tol = PARITY_TOLERANCE[precision]
    max_abs = float(everything.max())
    return {"ok": max_abs <= tol, "pair": "megatron-transformers", "dtype": precision, "max_abs_diff": max_abs,
            "mean_abs_diff": float(everything.mean()), "tolerance": tol, "prompts": len(prompts),
            "tokens": int(everything.numel())}


def bench(cuda: bool) -> dict:
    if not cuda:
        return {"ok": True, "skipped": "CPU dry run (`perpetua bench learner` measures the CPU learner)"}
    from ops.bench.learner import run_bench

    out = run_bench(rounds=6, warmup=2)
    return {"ok": True, "ratio": out["ratio"], "baseline_tokens_per_s": out["baseline"]["tokens_per_s"],
            "candidate_tokens_per_s": out["candidate"]["tokens_per_s"], "setup": out["setup"]}


def run_check() -> dict:
    t0 = time.perf_counter()
    block_forbidden()
    installed = ensure_packages()
    import torch

    cuda = torch.cuda.is_available()
    report: dict = {
        "cuda": cuda,
        "device": torch.cuda.get_device_name(0) if cuda else platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "megatron_core": None,
        "transformer_engine": importlib.util.find_spec("transformer_engine") is not None,
        "installed_from_wheels": installed,
    }
    from megatron.core import package_info

    from ops.policy.model import init_single_process

    report["megatron_core"] = package_info.__version__
    init_single_process(0)  # NCCL on CUDA, gloo on CPU
    learner_box: list = []

    def _step():
        out, learner = learner_step(cuda)
        learner_box.append(learner)
        return out

    report["learner_step"] = _part(_step)
    report["learner_job"] = _part(learner_job, cuda)
    report["distributed_optimizer"] = (_part(distributed_optimizer_step) if cuda
                                       else {"ok": True, "skipped": "needs CUDA (megatron's optimizer is CUDA-only)"})
    report["parity"] = (_part(parity, learner_box[0], cuda) if learner_box
                        else {"ok": False, "error": "no learner (the learner step failed)"})
    report["bench"] = _part(bench, cuda)
    report["vllm"] = {"tested": False, "reason": VLLM_NOT_TESTED}
    loaded = forbidden_loaded()
    report["import_chain"] = {"ok": not loaded, "forbidden": list(FORBIDDEN), "blocked": True, "loaded": loaded}
    parts = ("import_chain", "learner_step", "learner_job", "distributed_optimizer", "parity", "bench")
    report["ok"] = all(report[p].get("ok") for p in parts)
    report["seconds"] = round(time.perf_counter() - t0, 2)
    return report


def main() -> int:
    # Engine logs go to standard error; standard output carries the one JSON object.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import contextlib

    try:
        with contextlib.redirect_stdout(sys.stderr):
            report = run_check()
    except SetupError as e:
        print(f"gpu-check: {e}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=2, default=str))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
