"""`perpetua bench rollout`: the rollout path cycles take against raw OpenAI-API calls, both
against the same vLLM server.

server    = one vLLM OpenAI-compatible server (ops.serving.vllm_server: started on a free port in
            a temporary home and stopped at the end, or a running one passed in); both sides are
            HTTP clients of it in this process, so the engine work is the same and the ratio is
            the cost of the client.
baseline  = the same episodes as raw `POST /v1/completions` calls (`requests`, one session per
            thread): G token-id prompts per task, one request per live episode and turn with the
            body ServerEngine sends (temperature, top_p, per-turn seed, budget, stop at
            newline/EOS, logprobs 0, token ids back), the tool line appended after each CALL. A
            turn's requests go out together through a pool as large as the candidate's
            (`ServerEngine.max_concurrency`) and the next turn starts when all are back, as the
            episode runner does. No engine contract, no bookkeeping, no rows.
candidate = what the rollouts stage runs: `ops.rollout.groups.generate_groups` through
            `ops.rollout.server.ServerEngine` (version checks around every call, retries, tool
            episodes, log-prob and loss-mask bookkeeping), timed until the ROLLOUTS rows are built.
ratio     = candidate tokens/s / baseline tokens/s (medians over the repeats) over
            model-generated tokens; > 1: the rollout path is faster, the goal is >= 0.9.

Fairness: the server's prefix cache is reset before every timed run, so neither side reuses KV
the other left; the sides alternate which goes first; each timed run gets a client of its own
(new connections, as each rollouts stage run builds its own engine), created before its window,
which starts before the prompts are tokenized. Both sides use the same seeds, so with the same
weights they sample the same episodes token for token (`episodes_identical_to_baseline`, and
equal tokens and episodes per repeat). Peak RSS of this process (the client; the server's
processes excluded) and of the server's process tree is sampled during each side's timed runs
(ops.bench.memory.TreeMemory). `server_steps` counts the engine steps of each run (vLLM's
metrics): the same tokens in many more steps means the server batched that run badly, which on
a machine with few cores happens to either side now and then and is why the ratio is of medians;
the candidate's `retries` count the turns ServerEngine sent again after a failed request.

Also measured: the server's start seconds, and the refit the deployment and the rollouts use
(`ServerEngine.load_weights` through the development endpoints): to a perturbed copy of the
weights and back. The policy: `model_dir`, else the base policy in PERPETUA_HOME
(models/base/hf, multi-turn tool episodes) if there is one, else a random tiny MoE (mostly
one-turn episodes).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ops.tasks import task_world
from ops.policy.bootstrap import random_policy
from ops.policy import tokenizer as tok_lib
from ops.rollout.episodes import turn_seed
from ops.rollout.groups import SamplingConfig, generate_groups, sample_seed
from ops.rollout.vllm_engine import EngineConfig

SAMPLE_INTERVAL_S = 0.1


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


class RawClient:
    """The baseline's HTTP client: plain `requests` against the OpenAI-compatible API, with the
    API key the server asks for; none of the project's backend code. `keep_alive=False` for a
    client whose calls are far apart: the server closes idle connections after a few seconds,
    and a request sent just as it does fails."""

    def __init__(self, url: str, key: str | None, concurrency: int, keep_alive: bool = True) -> None:
        self.url = url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {key}"} if key else {}
        if not keep_alive:
            self._headers["Connection"] = "close"
        self._local = threading.local()
        self._pool = ThreadPoolExecutor(concurrency, thread_name_prefix="raw-http")
        card = self._request("GET", "/v1/models")["data"][0]
        self.model, self.max_model_len = card["id"], int(card.get("max_model_len") or 2**31)

    def _session(self):
        import requests

        session = getattr(self._local, "session", None)
        if session is None:
            session = self._local.session = requests.Session()
            session.headers.update(self._headers)
        return session

    def _request(self, method: str, path: str, body: dict | None = None):
        r = self._session().request(method, self.url + path, json=body, timeout=300)
        r.raise_for_status()
        return r.json() if r.content else None

    def _complete(self, body: dict) -> list[int]:
        return list(self._request("POST", "/v1/completions", body)["choices"][0]["token_ids"])

    def complete_all(self, bodies: list[dict]) -> list[list[int]]:
        """Every body at once (the server batches them), the sampled token ids in order."""
        return list(self._pool.map(self._complete, bodies))

    def reset_prefix_cache(self, tries: int = 20) -> None:
        """Drop the server's cached KV, so a timed run starts from the same cold cache."""
        for _ in range(tries):  # vLLM refuses while blocks are still held; they are freed shortly
            if (self._request("POST", "/reset_prefix_cache") or {}).get("success", True):
                return
            time.sleep(0.1)
        raise RuntimeError(f"{self.url} did not reset its prefix cache")

    def engine_steps(self) -> float | None:
        """The server's count of engine steps (vLLM's Prometheus metrics); None if it has none."""
        import requests

        try:
            r = self._session().get(self.url + "/metrics", timeout=30)
            r.raise_for_status()
        except requests.RequestException:
            return None
        counts = [float(line.rsplit(" ", 1)[1]) for line in r.text.splitlines()
                  if line.startswith("vllm:iteration_tokens_total_count")]
        return sum(counts) if counts else None

    def close(self) -> None:
        self._pool.shutdown()


def _raw_episodes(client: RawClient, tokenizer, tasks, cfg: SamplingConfig, cycle: int):
    """The baseline: the same episodes written directly as /v1/completions requests.

    Same per-turn seeds, stops, budgets and request body as ops.rollout.episodes and ServerEngine,
    so with the same weights it samples the same tokens; what it leaves out is the project's
    machinery (engine contract, version checks, retries, log-prob/mask bookkeeping, rows).
    """
    nl, eos = tok_lib.newline_id(tokenizer), tokenizer.eos_token_id
    eps = []
    for task in tasks:
        prompt = tokenizer.encode(task_world.prompt_text(task))
        for i in range(cfg.group_size):
            eps.append({"ids": list(prompt), "n": len(prompt), "turn": 0, "generated": 0,
                        "seed": sample_seed(cfg.seed, cycle, task.task_id, i)})
    live = eps
    while live:
        batch, bodies = [], []
        for e in live:
            budget = min(cfg.max_tokens - (len(e["ids"]) - e["n"]), client.max_model_len - len(e["ids"]))
            if e["turn"] >= task_world.MAX_TURNS or budget < 1:
                continue
            batch.append(e)
            bodies.append({
                "model": client.model, "prompt": list(e["ids"]), "max_tokens": budget, "temperature": cfg.temperature,
                "top_p": cfg.top_p, "stop_token_ids": [nl, eos], "seed": turn_seed(e["seed"], e["turn"]),
                "logprobs": 0, "return_tokens_as_token_ids": True, "return_token_ids": True,
                "skip_special_tokens": False,
            })  # fmt: skip
        outs = client.complete_all(bodies) if batch else []
        live = [e for e, toks in zip(batch, outs) if _advance(e, toks, tokenizer, cfg, client.max_model_len, nl)]
    return [e["ids"][e["n"]:] for e in eps], sum(e["generated"] for e in eps)


def _advance(e: dict, toks: list[int], tokenizer, cfg: SamplingConfig, max_model_len: int, nl: int) -> bool:
    """Append a turn's tokens (and the tool line after a CALL); True if the episode goes on."""
    e["ids"] += toks
    e["generated"] += len(toks)
    e["turn"] += 1
    if not toks or toks[-1] != nl:
        return False  # EOS or out of tokens: the episode ends
    action = task_world.parse_action(tokenizer.decode(toks[:-1], skip_special_tokens=False))
    if action.kind != "call":
        return False
    tool = tokenizer.encode(task_world.tool_result_line(action.argument), add_special_tokens=False)
    if len(e["ids"]) - e["n"] + len(tool) > cfg.max_tokens or len(e["ids"]) + len(tool) > max_model_len:
        return False
    e["ids"] += tool
    return True


def _server_kind(argv: list[str]) -> str | None:
    from ops.serving.vllm_server import ENTRYPOINT

    return "server" if ENTRYPOINT in argv else None


class SideMemory:
    """Peak RSS during one timed run: this process (a server it started is left out, it is
    sampled as the server) and the server's process tree."""

    def __init__(self, server_pid: int) -> None:
        from ops.bench.memory import TreeMemory

        self.client = TreeMemory(os.getpid(), _server_kind, "client", {"client": {"client"}}, SAMPLE_INTERVAL_S)
        self.server = TreeMemory(server_pid, lambda argv: None, "server", {"server": None}, SAMPLE_INTERVAL_S)

    def __enter__(self) -> "SideMemory":
        self.client.__enter__()
        self.server.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.server.__exit__(*exc)
        self.client.__exit__(*exc)

    def peaks_mb(self) -> tuple[float, float]:
        return self.client.peak_mb["client"], self.server.peak_mb["server"]


def _timed(run, admin: RawClient, server_pid: int) -> dict:
    """One timed run from a cold prefix cache: what `run()` returns, its seconds, peak RSS and
    the server's engine steps (how well the server batched the run's requests)."""
    admin.reset_prefix_cache()
    steps = admin.engine_steps()
    with SideMemory(server_pid) as mem:
        start = time.monotonic()
        out = run()
        seconds = time.monotonic() - start
    client_mb, server_mb = mem.peaks_mb()
    after = admin.engine_steps()
    return {"out": out, "seconds": seconds, "client_mb": client_mb, "server_mb": server_mb,
            "steps": None if steps is None or after is None else int(after - steps)}


def _baseline_run(server, key: str | None, concurrency: int, admin: RawClient, tokenizer, tasks, cfg, rep: int) -> dict:
    """One timed baseline run on a client of its own (new connections, as the candidate's)."""
    client = RawClient(server.url, key, concurrency)
    try:
        return _timed(lambda: _raw_episodes(client, tokenizer, tasks, cfg, rep), admin, server.pid)
    finally:
        client.close()


def _candidate_run(server, key: str | None, version: int, admin: RawClient, tokenizer, tasks, cfg, rep: int) -> dict:
    """One timed candidate run on a ServerEngine of its own, as each rollouts stage run builds one."""
    from ops.rollout.server import ServerEngine

    engine = ServerEngine([server.url], api_key=key)
    try:
        run = _timed(lambda: generate_groups(engine, tokenizer, tasks, cfg, cycle=rep, require_version=version),
                     admin, server.pid)
        return run | {"retries": engine.stats.retries}
    finally:
        engine.close()


def _side(what: str, runs: list[dict], tokens: list[int], episodes: list[int]) -> dict:
    """A side's reported figures; tokens/s is the median over the repeats of the reported runs."""
    seconds = [round(r["seconds"], 4) for r in runs]
    return {
        "what": what, "tokens": tokens, "episodes": episodes, "seconds": seconds,
        "tokens_per_s": round(statistics.median(t / s for t, s in zip(tokens, seconds)), 1),
        "peak_client_rss_mb": round(max(r["client_mb"] for r in runs), 1),
        "peak_server_rss_mb": round(max(r["server_mb"] for r in runs), 1),
        "server_steps": [r["steps"] for r in runs],
    }  # fmt: skip


def _default_policy(work: Path) -> Path:
    from ops.common.paths import home

    base = home().models / "base" / "hf"
    return base if (base / "config.json").exists() else random_policy(work / "policy")


def _measure(model_dir: Path, server, key: str | None, tasks, cfg: SamplingConfig, repeats: int, work: Path) -> dict:
    """Both sides against `server` (warm-up, alternating timed runs), then the refit."""
    from ops.rollout.server import ServerEngine

    tokenizer = tok_lib.load_hf_tokenizer(model_dir)
    with ServerEngine([server.url], api_key=key) as engine:
        version, n = engine.policy_version, engine.max_concurrency
    admin = RawClient(server.url, key, 1, keep_alive=False)
    try:
        # Warm-up (a fresh server's first batches are slow): both sides, small, other seeds.
        _baseline_run(server, key, n, admin, tokenizer, tasks[:2], cfg, 99)
        _candidate_run(server, key, version, admin, tokenizer, tasks[:2], cfg, 98)
        base, cand = [], []
        for rep in range(repeats):
            for which in ("baseline", "candidate") if rep % 2 == 0 else ("candidate", "baseline"):
                if which == "baseline":
                    base.append(_baseline_run(server, key, n, admin, tokenizer, tasks, cfg, rep))
                else:
                    cand.append(_candidate_run(server, key, version, admin, tokenizer, tasks, cfg, rep))
    finally:
        admin.close()
    refit_dir = perturbed_copy(model_dir, work / "refit", version=(version or 0) + 1)
    with ServerEngine([server.url], api_key=key) as engine:  # a client of its own, as the deploy step's
        refits = [engine.load_weights(refit_dir), engine.load_weights(model_dir, version)]
        return {"base": base, "cand": cand, "refits": refits, "concurrency": n,
                "max_model_len": engine.max_model_len, "refit_method": engine.refit_method}


def _result(m: dict, server, reused: bool, model_dir: Path, n_tasks: int, cfg: SamplingConfig, repeats: int,
            engine_config: EngineConfig) -> dict:
    """The `bench --json` dict from the measured runs of both sides."""
    base_tokens = [r["out"][1] for r in m["base"]]
    cand_tokens = [r["out"].completion_tokens for r in m["cand"]]
    same = [b == r["completion_ids"] for run_b, run_c in zip(m["base"], m["cand"])
            for b, r in zip(run_b["out"][0], run_c["out"].rows)]
    baseline = _side("the same episodes as raw POST /v1/completions calls (requests, same bodies, seeds, stops, "
                     "tool lines and concurrency), no rollout machinery", m["base"], base_tokens,
                     [len(r["out"][0]) for r in m["base"]])
    candidate = _side("ops.rollout.groups.generate_groups through ServerEngine (the rollouts stage): multi-turn tool "
                      "episodes, ROLLOUTS rows", m["cand"], cand_tokens, [len(r["out"].rows) for r in m["cand"]])
    last = m["cand"][-1]["out"]
    candidate |= {
        "retries": [r["retries"] for r in m["cand"]],
        "finish_reasons": last.finish_reasons,
        "mean_turns": round(sum(r["turns"] for r in last.rows) / len(last.rows), 3),
        "episodes_identical_to_baseline": round(sum(same) / len(same), 4),
    }
    return {
        "name": "rollout",
        "ratio": round(candidate["tokens_per_s"] / baseline["tokens_per_s"], 4),
        "baseline": baseline,
        "candidate": candidate,
        "refit": {
            "method": f"ServerEngine.load_weights: /pause, /collective_rpc {m['refit_method']}, /reset_prefix_cache, "
                      "/resume (to a perturbed copy, then back)",
            "seconds": [round(r.seconds, 4) for r in m["refits"]], "bytes": m["refits"][0].bytes,
        },
        "server": {"url": server.url, "reused": reused, "start_seconds": None if reused else round(server.start_seconds, 2),
                   "max_num_seqs": engine_config.max_num_seqs, "max_model_len": m["max_model_len"]},
        "config": {"model_dir": str(model_dir), "tasks": n_tasks, "group_size": cfg.group_size,
                   "max_tokens": cfg.max_tokens, "repeats": repeats, "sequences": n_tasks * cfg.group_size,
                   "concurrency": m["concurrency"], "prefix_cache": "reset before every timed run"},
        "machine": {"cpu_count": os.cpu_count()},
    }  # fmt: skip


def run_bench(
    model_dir: str | Path | None = None,
    n_tasks: int = 32,
    group_size: int = 8,
    max_tokens: int = 64,
    repeats: int = 5,
    engine_config: EngineConfig | None = None,
    server=None,
    api_key: str | None = None,
) -> dict:
    """Run the benchmark; returns the `bench --json` dict (docs/architecture.md: name, ratio, baseline, candidate).

    `server`: a running `vllm_server.VllmServer` serving `model_dir` (its url and pid are used;
    `api_key` defaults to this home's key); None starts one for the bench and stops it after.
    """
    from ops.common.paths import Home
    from ops.serving import vllm_server
    from ops.serving.api_key import api_key as home_key

    engine_config = engine_config or EngineConfig()
    cfg = SamplingConfig(group_size=group_size, temperature=1.0, top_p=1.0, max_tokens=max_tokens, seed=0)
    tasks = bench_tasks(n_tasks)
    work = Path(tempfile.mkdtemp(prefix="perpetua-bench-rollout-"))
    h, port = None, None
    try:
        model_dir = Path(model_dir or (server.model_dir if server else _default_policy(work)))
        reused = server is not None
        if server is None:
            h = Home(work / "home").ensure()
            server = vllm_server.start_on_free_port(model_dir, engine_config, h=h,
                                                    policy_version=_policy_version(model_dir))
            port = server.port
            api_key = home_key(h.root)
        elif api_key is None:
            api_key = home_key(create=False)
        m = _measure(model_dir, server, api_key, tasks, cfg, repeats, work)
        return _result(m, server, reused, model_dir, len(tasks), cfg, repeats, engine_config)
    finally:
        if port is not None:
            vllm_server.stop(port, h=h)
        shutil.rmtree(work, ignore_errors=True)


def _policy_version(model_dir: Path) -> int:
    """The version the bench's server is labelled with: the policy's own, else 0 (an unlabelled
    server is refused by the rollout path)."""
    from ops.rollout.engine import read_policy_version

    declared = read_policy_version(model_dir)
    return 0 if declared is None else declared


if __name__ == "__main__":
    print(json.dumps(run_bench(), indent=2))
