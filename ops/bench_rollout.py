"""`perpetua bench rollout`: the rollout path against raw vLLM, side by side in one process.

baseline  = `vllm.LLM.generate` called directly: the same token-id prompts (G per task) and
            the same SamplingParams (temperature, top_p, per-sample seed, max_tokens, stop at
            newline/EOS, logprobs=0), one call.
candidate = the project's path, `ops.rollout.groups.generate_groups` on the same engine:
            TurnRequests through the RolloutEngine contract (version checks, retries, timeout
            thread), multi-turn episodes (tool calls, RESULT tokens), ROLLOUTS rows.
ratio     = candidate tokens/s / baseline tokens/s over model-generated tokens (> 1: the rollout
            path is faster; the goal is >= 0.9, i.e. at most 10% overhead).

The first turn of every episode uses the same seed as the baseline request, so with the same
weights both paths sample the same first-turn tokens (`first_turn_identical` says how often).
With a policy that calls the tool, the candidate also runs the later turns (more, smaller
engine calls), which is the real cost of multi-turn rollouts. The default policy is a random
tiny MoE (mostly one-turn episodes: the comparison is then pure overhead).

Also measured: engine start seconds, and refit seconds and bytes (in-place reload of a
perturbed copy of the weights, `reload_weights_repacked`).
"""

from __future__ import annotations

import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from ops import task_world
from ops import tokenizer as tok_lib
from ops.rollout.episodes import turn_seed
from ops.rollout.groups import SamplingConfig, generate_groups, sample_seed
from ops.vllm_engine import EngineConfig


def random_policy(out_dir: Path, seed: int = 1234) -> Path:
    """A tiny random policy (the embedded default's shape), exported like every policy is."""
    from ops import checkpoint, hf_convert
    from ops.policy_model import PRESETS, build_model, init_single_process

    cfg = PRESETS["tiny"]
    out_dir = Path(out_dir)
    tok_lib.save_hf_tokenizer(tok_lib.train_tokenizer(cfg.vocab_size), out_dir / "tokenizer")
    tokenizer = tok_lib.load_hf_tokenizer(out_dir / "tokenizer")
    init_single_process()
    model = build_model(cfg, seed=seed)
    sd = checkpoint.global_state_dict(model, cfg.num_experts)
    return hf_convert.export_hf(cfg, sd, out_dir / "hf", tokenizer, extra={"perpetua_policy_version": 0})


def perturbed_copy(src: Path, dst: Path, version: int, noise: float = 0.1) -> Path:
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    g = torch.Generator().manual_seed(version)
    for name, t in tensors.items():
        if t.dim() == 2:
            tensors[name] = t + noise * t.std() * torch.randn(t.shape, generator=g)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(cfg | {"perpetua_policy_version": version}))
    return dst


def bench_tasks(n_tasks: int, seed: int = 0) -> list[task_world.Task]:
    fams = task_world.BOOTSTRAP_FAMILIES
    per = -(-n_tasks // len(fams))
    return [t for f in fams for t in task_world.generate_tasks(f, per, seed)][:n_tasks]


def _raw_generate(llm, tokenizer, tasks, cfg: SamplingConfig, cycle: int) -> tuple[list[list[int]], float]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    stops = [tok_lib.newline_id(tokenizer), tokenizer.eos_token_id]
    prompts, params = [], []
    for task in tasks:
        ids = tokenizer.encode(task_world.prompt_text(task))
        for i in range(cfg.group_size):
            prompts.append(TokensPrompt(prompt_token_ids=ids))
            params.append(SamplingParams(
                n=1, temperature=cfg.temperature, top_p=cfg.top_p, max_tokens=cfg.max_tokens, stop_token_ids=stops,
                seed=turn_seed(sample_seed(cfg.seed, cycle, task.task_id, i), 0), logprobs=0, detokenize=False,
            ))  # fmt: skip
    start = time.monotonic()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.monotonic() - start
    return [list(o.outputs[0].token_ids) for o in outs], seconds


def run_bench(
    model_dir: str | Path | None = None,
    n_tasks: int = 32,
    group_size: int = 8,
    max_tokens: int = 64,
    repeats: int = 3,
    engine_config: EngineConfig | None = None,
) -> dict:
    """Run the benchmark; returns the `bench --json` dict (DESIGN.md: name, ratio, baseline, candidate)."""
    from ops.rollout.offline import OfflineEngine

    work = Path(tempfile.mkdtemp(prefix="perpetua-bench-rollout-"))
    try:
        model_dir = Path(model_dir) if model_dir is not None else random_policy(work / "policy")
        tokenizer = tok_lib.load_hf_tokenizer(model_dir)
        cfg = SamplingConfig(group_size=group_size, temperature=1.0, top_p=1.0, max_tokens=max_tokens, seed=0)
        tasks = bench_tasks(n_tasks)
        start = time.monotonic()
        engine = OfflineEngine(model_dir, engine_config or EngineConfig(max_num_seqs=256))
        engine_start = time.monotonic() - start
        try:
            version = engine.policy_version
            # Warm-up (the first batch of a fresh engine is slow): both paths, small.
            _raw_generate(engine.llm, tokenizer, tasks[:2], cfg, cycle=99)
            generate_groups(engine, tokenizer, tasks[:2], cfg, cycle=98)

            base_runs, cand_runs = [], []
            for rep in range(repeats):
                order = ("baseline", "candidate") if rep % 2 == 0 else ("candidate", "baseline")
                for which in order:
                    if which == "baseline":
                        ids, seconds = _raw_generate(engine.llm, tokenizer, tasks, cfg, cycle=rep)
                        base_runs.append((sum(map(len, ids)), seconds, ids))
                    else:
                        batch = generate_groups(engine, tokenizer, tasks, cfg, cycle=rep, require_version=version)
                        cand_runs.append((batch.completion_tokens, batch.seconds, batch))
            base_tps = [t / s for t, s, _ in base_runs]
            cand_tps = [t / s for t, s, _ in cand_runs]
            # Same seeds, same weights: the first turn of each episode equals the raw sample.
            raw_ids, rows = base_runs[0][2], cand_runs[0][2].rows
            identical = sum(r["completion_ids"][: len(b)] == b for r, b in zip(rows, raw_ids)) / len(rows)

            refit_dir = perturbed_copy(model_dir, work / "refit", version=(version or 0) + 1)
            refits = [engine.load_weights(refit_dir), engine.load_weights(model_dir, version)]
        finally:
            engine.close()
        last = cand_runs[-1][2]
        return {
            "name": "rollout",
            "ratio": round(statistics.median(cand_tps) / statistics.median(base_tps), 4),
            "baseline": {
                "what": "raw vllm.LLM.generate: same token prompts and SamplingParams (seeds, stops), one call",
                "tokens": [t for t, _, _ in base_runs], "seconds": [round(s, 4) for _, s, _ in base_runs],
                "tokens_per_s": round(statistics.median(base_tps), 1),
            },
            "candidate": {
                "what": "ops.rollout.groups.generate_groups: multi-turn tool episodes via RolloutEngine, ROLLOUTS rows",
                "tokens": [t for t, _, _ in cand_runs], "seconds": [round(s, 4) for _, s, _ in cand_runs],
                "tokens_per_s": round(statistics.median(cand_tps), 1),
                "finish_reasons": last.finish_reasons,
                "mean_turns": round(sum(r["turns"] for r in last.rows) / len(last.rows), 3),
                "first_turn_identical": round(identical, 4),
            },
            "refit": {
                "method": "collective_rpc reload_weights_repacked (in place) + prefix cache reset",
                "seconds": [round(r.seconds, 4) for r in refits], "bytes": refits[0].bytes,
            },
            "engine_start_seconds": round(engine_start, 2),
            "config": {"model_dir": str(model_dir), "tasks": len(tasks), "group_size": group_size,
                       "max_tokens": max_tokens, "repeats": repeats, "sequences": len(tasks) * group_size},
        }  # fmt: skip
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    print(json.dumps(run_bench(), indent=2))
