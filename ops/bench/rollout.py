"""`perpetua bench rollout`: the rollout path against raw vLLM, side by side in one process.

baseline  = the same episodes written directly against `vllm.LLM.generate`: G token-id prompts
            per task, one generate call per turn with the same SamplingParams (temperature,
            top_p, per-turn seed, budget, stop at newline/EOS, logprobs=0), the tool line
            appended after each CALL; no engine contract, no bookkeeping, no rows.
candidate = the project's path, `ops.rollout.groups.generate_groups` on the same engine:
            TurnRequests through the RolloutEngine contract (version checks, retries, timeout
            thread), multi-turn episodes (tool calls, RESULT tokens), ROLLOUTS rows.
ratio     = candidate tokens/s / baseline tokens/s over model-generated tokens (> 1: the rollout
            path is faster; the goal is >= 0.9, i.e. at most 10% overhead).

Both paths use the same seeds, so with the same weights they sample the same episodes token for
token (`episodes_identical_to_baseline`): they do the same vLLM work, and the ratio is the
rollout path's overhead. The policy: `model_dir`, else the base policy in PERPETUA_HOME
(models/base/hf, multi-turn tool episodes) if there is one, else a random tiny MoE (mostly
one-turn episodes).

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

from ops.tasks import task_world
from ops.policy.bootstrap import random_policy
from ops.policy import tokenizer as tok_lib
from ops.rollout.episodes import turn_seed
from ops.rollout.groups import SamplingConfig, generate_groups, sample_seed
from ops.rollout.vllm_engine import EngineConfig




def perturbed_copy(src: Path, dst: Path, version: int, noise: float = 0.1, seed: int | None = None) -> Path:
    """A second policy: the same architecture, weights moved by noise, a bumped version."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    g = torch.Generator().manual_seed(version if seed is None else seed)
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


def _raw_episodes(llm, tokenizer, tasks, cfg: SamplingConfig, cycle: int, max_model_len: int):
    """The baseline: the same episodes written directly against `vllm.LLM.generate`.

    Same per-turn seeds, stops and budgets as ops.rollout.episodes, so with the same weights it
    samples the same tokens; what it leaves out is the project's machinery (engine contract,
    version checks, retries, log-prob/mask bookkeeping, rows).
    """
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    nl, eos = tok_lib.newline_id(tokenizer), tokenizer.eos_token_id
    stops = [nl, eos]
    eps = []
    for task in tasks:
        prompt = tokenizer.encode(task_world.prompt_text(task))
        for i in range(cfg.group_size):
            eps.append({"ids": list(prompt), "n": len(prompt), "turn": 0, "generated": 0,
                        "seed": sample_seed(cfg.seed, cycle, task.task_id, i)})
    start = time.monotonic()
    live = eps
    while live:
        batch, prompts, params = [], [], []
        for e in live:
            budget = min(cfg.max_tokens - (len(e["ids"]) - e["n"]), max_model_len - len(e["ids"]))
            if e["turn"] >= task_world.MAX_TURNS or budget < 1:
                continue
            batch.append(e)
            prompts.append(TokensPrompt(prompt_token_ids=e["ids"]))
            params.append(SamplingParams(
                n=1, temperature=cfg.temperature, top_p=cfg.top_p, max_tokens=budget, stop_token_ids=stops,
                seed=turn_seed(e["seed"], e["turn"]), logprobs=0, detokenize=False, skip_special_tokens=False,
            ))  # fmt: skip
        outs = llm.generate(prompts, params, use_tqdm=False) if batch else []
        live = []
        for e, out in zip(batch, outs):
            toks = list(out.outputs[0].token_ids)
            e["ids"] += toks
            e["generated"] += len(toks)
            e["turn"] += 1
            if not toks or toks[-1] != nl:
                continue  # EOS or out of tokens: the episode ends
            action = task_world.parse_action(tokenizer.decode(toks[:-1], skip_special_tokens=False))
            if action.kind != "call":
                continue
            tool = tokenizer.encode(task_world.tool_result_line(action.argument), add_special_tokens=False)
            if len(e["ids"]) - e["n"] + len(tool) > cfg.max_tokens or len(e["ids"]) + len(tool) > max_model_len:
                continue
            e["ids"] += tool
            live.append(e)
    seconds = time.monotonic() - start
    return [e["ids"][e["n"]:] for e in eps], sum(e["generated"] for e in eps), seconds


def run_bench(
    model_dir: str | Path | None = None,
    n_tasks: int = 32,
    group_size: int = 8,
    max_tokens: int = 64,
    repeats: int = 3,
    engine_config: EngineConfig | None = None,
) -> dict:
    """Run the benchmark; returns the `bench --json` dict (docs/architecture.md: name, ratio, baseline, candidate)."""
    from ops.rollout.offline import OfflineEngine

    work = Path(tempfile.mkdtemp(prefix="perpetua-bench-rollout-"))
    try:
        if model_dir is None:
            from ops.common.paths import home

            base = home().models / "base" / "hf"
            model_dir = base if (base / "config.json").exists() else random_policy(work / "policy")
        model_dir = Path(model_dir)
        tokenizer = tok_lib.load_hf_tokenizer(model_dir)
        cfg = SamplingConfig(group_size=group_size, temperature=1.0, top_p=1.0, max_tokens=max_tokens, seed=0)
        tasks = bench_tasks(n_tasks)
        start = time.monotonic()
        engine = OfflineEngine(model_dir, engine_config or EngineConfig(max_num_seqs=256))
        engine_start = time.monotonic() - start
        try:
            version = engine.policy_version
            # Warm-up (the first batch of a fresh engine is slow): both paths, small.
            _raw_episodes(engine.llm, tokenizer, tasks[:2], cfg, 99, engine.max_model_len)
            generate_groups(engine, tokenizer, tasks[:2], cfg, cycle=98)

            base_runs, cand_runs = [], []
            for rep in range(repeats):
                order = ("baseline", "candidate") if rep % 2 == 0 else ("candidate", "baseline")
                for which in order:
                    if which == "baseline":
                        ids, tokens, seconds = _raw_episodes(engine.llm, tokenizer, tasks, cfg, rep, engine.max_model_len)
                        base_runs.append((tokens, seconds, ids))
                    else:
                        batch = generate_groups(engine, tokenizer, tasks, cfg, cycle=rep, require_version=version)
                        cand_runs.append((batch.completion_tokens, batch.seconds, batch))
            base_tps = [t / s for t, s, _ in base_runs]
            cand_tps = [t / s for t, s, _ in cand_runs]
            # Same seeds, same weights: both paths sample the same episodes, token for token.
            raw_ids, rows = base_runs[0][2], cand_runs[0][2].rows
            identical = sum(r["completion_ids"] == b for r, b in zip(rows, raw_ids)) / len(rows)

            refit_dir = perturbed_copy(model_dir, work / "refit", version=(version or 0) + 1)
            refits = [engine.load_weights(refit_dir), engine.load_weights(model_dir, version)]
        finally:
            engine.close()
        last = cand_runs[-1][2]
        return {
            "name": "rollout",
            "ratio": round(statistics.median(cand_tps) / statistics.median(base_tps), 4),
            "baseline": {
                "what": "the same episodes as direct vllm.LLM.generate calls (same seeds, stops, tool lines), no rollout machinery",
                "tokens": [t for t, _, _ in base_runs], "seconds": [round(s, 4) for _, s, _ in base_runs],
                "tokens_per_s": round(statistics.median(base_tps), 1),
            },
            "candidate": {
                "what": "ops.rollout.groups.generate_groups: multi-turn tool episodes via RolloutEngine, ROLLOUTS rows",
                "tokens": [t for t, _, _ in cand_runs], "seconds": [round(s, 4) for _, s, _ in cand_runs],
                "tokens_per_s": round(statistics.median(cand_tps), 1),
                "finish_reasons": last.finish_reasons,
                "mean_turns": round(sum(r["turns"] for r in last.rows) / len(last.rows), 3),
                "episodes_identical_to_baseline": round(identical, 4),
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
