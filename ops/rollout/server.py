"""The server backend: one or more vLLM OpenAI-compatible servers, over HTTP, token-in/token-out.

Generation is `POST /v1/completions` with the prompt as a list of token ids and
`"logprobs": 0, "return_tokens_as_token_ids": true`: the response names every sampled token
as `token_id:N` with its log-prob, so nothing is re-tokenized. Requests of one call go out
concurrently (the server batches them) and are spread round-robin over the servers; a request
whose server does not answer is sent to the next one.

Refit and versions use vLLM's development endpoints (the server must run with
`VLLM_SERVER_DEV_MODE=1`, bound to 127.0.0.1: they are admin endpoints):
`POST /pause?mode=wait` (let in-flight requests finish), `POST /collective_rpc` with
`{"method": "reload_weights_repacked", "kwargs": {"weights_path": DIR}}` (vLLM's
`reload_weights` plus the MoE prepack it skips on CPU, ops.rollout.vllm_worker; DIR must be
readable by the server process), `POST /reset_prefix_cache` (no KV from the old weights is reused),
`POST /update_weight_version`, `POST /resume`. `GET /weight_info` reports the label, read
before and after every generate call: a version that changed under a call fails it rather
than mixing two policies in one batch.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import threading
import time
from pathlib import Path
from typing import Callable

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
)
from ops.rollout.vllm_worker import REFIT_METHOD

log = logging.getLogger(__name__)


class _HttpError(Exception):
    def __init__(self, status: int, text: str) -> None:
        super().__init__(f"HTTP {status}: {text[:500]}")
        self.status = status


class RoundRobin:
    """A router over base URLs: each pick is the next server in turn (thread-safe)."""

    def __init__(self, urls: list[str]) -> None:
        if not urls:
            raise ValueError("at least one server URL is needed")
        self.urls = [u.rstrip("/") for u in urls]
        self._next = itertools.cycle(range(len(self.urls)))
        self._lock = threading.Lock()

    def order(self) -> list[str]:
        """All servers, starting with the next one in turn (the rest are fail-over)."""
        with self._lock:
            i = next(self._next)
        return self.urls[i:] + self.urls[:i]


class ServerEngine(RolloutEngine):
    """Client of vLLM servers. `restart` (optional) brings a dead server back, e.g. the supervisor's."""

    def __init__(
        self,
        base_urls: str | list[str],
        *,
        policy_version: int | None = None,
        retry: RetryPolicy | None = None,
        request_timeout_s: float = 300.0,
        max_concurrency: int = 64,
        restart: Callable[[], None] | None = None,
        refit_method: str = REFIT_METHOD,
        api_key: str | None = None,
    ) -> None:
        """`api_key`: sent as a Bearer token on every request; default: PERPETUA_VLLM_API_KEY,
        else the key of this PERPETUA_HOME's servers (ops/serving/api_key.py)."""
        super().__init__(retry)
        if api_key is None:
            from ops.serving.api_key import api_key as home_key

            api_key = home_key(create=False)
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.refit_method = refit_method
        self.router = RoundRobin([base_urls] if isinstance(base_urls, str) else list(base_urls))
        self.request_timeout_s = request_timeout_s
        self.max_concurrency = max_concurrency
        self._restart_hook = restart
        self._local = threading.local()
        self._pool = concurrent.futures.ThreadPoolExecutor(max_concurrency, thread_name_prefix="vllm-http")
        self.weights_dir: Path | None = None
        self._connect()
        if policy_version is not None:
            self._set_version(policy_version)

    # ---- HTTP -------------------------------------------------------------------------------

    def _session(self):
        import requests

        s = getattr(self._local, "session", None)
        if s is None:
            s = self._local.session = requests.Session()
            s.headers.update(self._headers)
        return s

    def _call(self, method: str, url: str, *, json=None, params=None, timeout: float | None = None):
        import requests

        try:
            r = self._session().request(method, url, json=json, params=params, timeout=timeout or 30.0)
        except requests.RequestException as e:
            raise EngineFailure(f"{method} {url}: {type(e).__name__}: {e}") from None
        if r.status_code >= 400:
            raise _HttpError(r.status_code, r.text)
        return r.json() if r.content else None

    def _connect(self) -> None:
        self.model, lens = None, []
        for url in self.router.urls:
            try:
                models = self._call("GET", f"{url}/v1/models", timeout=10.0)
                self._call("GET", f"{url}/weight_info", timeout=10.0)
            except EngineFailure as e:
                raise EngineStartError(f"no vLLM server answers at {url}: {e}") from None
            except _HttpError as e:
                raise EngineStartError(
                    f"vLLM server at {url} has no /weight_info ({e}): start it with VLLM_SERVER_DEV_MODE=1 "
                    "(ops.serving.vllm_server does) so refit and version checks work"
                ) from None
            card = models["data"][0]
            if self.model is not None and card["id"] != self.model:
                raise EngineStartError(f"servers serve different models: {self.model!r} and {card['id']!r}")
            self.model = card["id"]
            lens.append(int(card.get("max_model_len") or 0))
        # A server that does not say (another OpenAI-compatible server) rejects what is too long itself.
        self._max_model_len = min(lens) if all(lens) else 2**31

    # ---- the contract -----------------------------------------------------------------------

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def policy_version(self) -> int | None:
        """The version every server reports; None if any is unlabelled or they disagree."""
        versions = set()
        for url in self.router.urls:
            try:
                versions.add(parse_weight_version(self._call("GET", f"{url}/weight_info", timeout=10.0)["weight_version"]))
            except (EngineFailure, _HttpError, KeyError, TypeError):
                return None
        return versions.pop() if len(versions) == 1 else None

    def _set_version(self, version: int | None) -> None:
        label = "unknown" if version is None else str(version)
        for url in self.router.urls:
            self._call("POST", f"{url}/update_weight_version", json={"new_version": label})

    def _generate(self, requests: list[TurnRequest]) -> list[TurnResult]:
        before = self.policy_version
        results = list(self._pool.map(self._one, requests))
        after = self.policy_version
        if before != after:
            raise PolicyVersionError(f"the served policy version changed during a generate call ({before} -> {after})")
        for r in results:
            if r.error is None:
                r.policy_version = before
        return results

    def _payload(self, r: TurnRequest) -> dict:
        body = {
            "model": self.model, "prompt": list(r.prompt_ids), "max_tokens": r.max_tokens,
            "temperature": r.temperature, "top_p": r.top_p, "stop_token_ids": list(r.stop_token_ids),
            "logprobs": 0, "return_tokens_as_token_ids": True, "return_token_ids": True,
            "skip_special_tokens": False,
        }  # fmt: skip
        if r.seed is not None:
            body["seed"] = r.seed
        return body

    def _one(self, r: TurnRequest) -> TurnResult:
        body, last = self._payload(r), None
        for url in self.router.order():
            try:
                resp = self._call("POST", f"{url}/v1/completions", json=body, timeout=self.request_timeout_s)
            except EngineFailure as e:  # no answer: try the next server
                last = e
                continue
            except _HttpError as e:
                if e.status >= 500:
                    last = EngineFailure(f"{url}: {e}")
                    continue
                return TurnResult([], [], "error", None, error=f"{url} rejected the request: {e}")
            return parse_completion(resp)
        raise last or EngineFailure("no server to send the request to")

    def _restart(self) -> None:
        if self._restart_hook is not None:
            self._restart_hook()
        deadline = time.monotonic() + 120.0
        while True:
            try:
                self._connect()
                break
            except EngineStartError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(2.0)
        if self.weights_dir is not None and self._restart_hook is not None:
            self._load_weights(self.weights_dir, self.stats.refits[-1].policy_version)

    def _load_weights(self, model_dir: Path, version: int) -> None:
        try:
            self._set_version(None)  # unknown until every server holds the new weights
            for url in self.router.urls:
                self._call("POST", f"{url}/pause", params={"mode": "wait"}, timeout=600.0)
                try:
                    self._call(
                        "POST", f"{url}/collective_rpc", timeout=600.0,
                        json={"method": self.refit_method, "kwargs": {"weights_path": str(model_dir)}},
                    )  # fmt: skip
                    self._call("POST", f"{url}/reset_prefix_cache")
                finally:
                    self._call("POST", f"{url}/resume")
            self._set_version(version)
        except (EngineFailure, _HttpError) as e:
            raise RefitError(f"refit of {self.router.urls} to {model_dir} failed: {e}") from e
        self.weights_dir = model_dir

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def parse_completion(resp: dict) -> TurnResult:
    """A /v1/completions response (one choice, logprobs with token ids) as a TurnResult."""
    choice = resp["choices"][0]
    lp = choice.get("logprobs") or {}
    tokens = lp.get("tokens") or []
    try:
        ids = [int(t.split(":", 1)[1]) for t in tokens]
    except (IndexError, ValueError):
        raise EngineFailure(f"server did not return token ids (return_tokens_as_token_ids): {tokens[:3]}") from None
    if choice.get("token_ids") is not None and list(choice["token_ids"]) != ids:
        raise EngineFailure("the server's token_ids and logprob tokens disagree")
    logprobs = [float(x) for x in lp.get("token_logprobs") or []]
    reason = choice.get("finish_reason")
    finish = reason if reason in ("stop", "length") else "error"
    stop = choice.get("stop_reason")
    stop = stop if isinstance(stop, int) else (ids[-1] if finish == "stop" and ids else None)
    return TurnResult(ids, logprobs, finish, None, stop_token_id=stop,
                      error=None if finish != "error" else f"finish_reason {reason!r}")
