"""Parity: the same weights in megatron-core, transformers and vLLM give the same per-token
log-probabilities on fixed prompts. A mismatch here would silently bias every importance ratio
of the learner, so it is checked as a command (`perpetua parity`) and in the tests.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import torch

from ops.tasks import task_world


def fixed_prompts(tokenizer) -> list[list[int]]:
    """Token ids of solved episodes, one per family (deterministic)."""
    tasks = [task_world.generate_tasks(f, 1, seed=7)[0] for f in task_world.FAMILIES]
    return [tokenizer.encode(task_world.solution_text(t)) for t in tasks]


def megatron_logprobs(hf_dir: Path, prompts: list[list[int]]) -> list[torch.Tensor]:
    from ops.policy import checkpoint
    from ops.policy import hf_convert
    from ops.policy.model import build_model, init_single_process, token_logprobs

    cfg, sd = hf_convert.import_hf(hf_dir)
    init_single_process()
    model = build_model(cfg)
    checkpoint.load_global_state_dict(model, sd, cfg.num_experts)
    model.eval()
    with torch.no_grad():
        return [token_logprobs(model, torch.tensor([p]))[0].cpu() for p in prompts]


def transformers_logprobs(hf_dir: Path, prompts: list[list[int]]) -> list[torch.Tensor]:
    from transformers import MixtralForCausalLM

    model = MixtralForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            logits = model(ids).logits.float()
            out.append(torch.log_softmax(logits[0, :-1], -1).gather(-1, ids[0, 1:, None]).squeeze(-1))
    return out


def vllm_logprobs(hf_dir: Path, prompts: list[list[int]], llm=None) -> list[torch.Tensor]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from ops.rollout.vllm_engine import make_llm, shutdown_llm

    own = llm is None
    llm = llm or make_llm(str(hf_dir))
    try:
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                            SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0), use_tqdm=False)
    finally:
        if own:
            shutdown_llm(llm)
    return [torch.tensor([o.prompt_logprobs[i][p[i]].logprob for i in range(1, len(p))]) for o, p in zip(outs, prompts)]


ENGINES = {"megatron": megatron_logprobs, "transformers": transformers_logprobs, "vllm": vllm_logprobs}


def run_parity(hf_dir: Path, engines: list[str] | None = None) -> dict:
    """{"max_abs_diff", "pairs": {"a-b": diff}, "prompts", "tokens"} over the fixed prompts."""
    from ops.policy.tokenizer import load_hf_tokenizer

    engines = engines or list(ENGINES)
    prompts = fixed_prompts(load_hf_tokenizer(hf_dir))
    lps = {name: ENGINES[name](Path(hf_dir), prompts) for name in engines}
    pairs = {}
    for a, b in itertools.combinations(engines, 2):
        pairs[f"{a}-{b}"] = max(float((x - y).abs().max()) for x, y in zip(lps[a], lps[b]))
    return {
        "max_abs_diff": max(pairs.values()) if pairs else 0.0,
        "pairs": pairs,
        "prompts": len(prompts),
        "tokens": sum(len(p) - 1 for p in prompts),
        "model_dir": str(hf_dir),
    }
