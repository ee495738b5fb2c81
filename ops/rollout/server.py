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

The servers are one role's pool. A member that stops answering (connection refused or reset,
a timeout) and whose `/health` does not answer either is taken out, with a warning: the
call's requests it had in flight go to the live members (no request reaches it after), the
version checks run over the live members only, and the failure is recorded (`failed_servers`,
`pool_record()`). A member taken out is used again only after it has been refit to the pool's
weights and reports the pool's version: at the next refit (`load_weights` refits every member),
or when every member is down and the engine restarts (the `restart` hook, e.g. the supervisor
starting the local servers again, then a refit of each). An HTTP 5xx answer sends the request
to the next member but does not take its server out (one bad request must not empty the pool).
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from dataclasses import asdict, dataclass
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


@dataclass
class Member:
    """One server of the pool and what it was sent: requests (attempts), answered, failed, now in flight."""

    url: str
    live: bool = True
    sent: int = 0
    answered: int = 0
    failed: int = 0
    in_flight: int = 0


@dataclass(frozen=True)
class ServerFailure:
    """A member taken out of the pool: why, when (epoch seconds), the requests it had in flight
    then (each is sent to a live member) and the requests it had been sent (none after)."""

    url: str
    error: str
    at: float
    in_flight: int
    sent: int


class RoundRobin:
    """The pool's router over base URLs: each pick starts with the next live member in turn, and
    the other live members follow as fail-over (thread-safe). It also keeps each member's counts
    and the members taken out, so a failure is reported rather than only logged."""

    def __init__(self, urls: list[str]) -> None:
        if not urls:
            raise ValueError("at least one server URL is needed")
        self.urls = [u.rstrip("/") for u in urls]
        if len(set(self.urls)) != len(self.urls):
            raise ValueError(f"a server URL is listed twice: {self.urls}")
        self.members = {u: Member(u) for u in self.urls}
        self.failures: list[ServerFailure] = []
        self.failovers = 0  # requests sent to another member after theirs failed
        self._turn = 0
        self._lock = threading.Lock()

    @property
    def live(self) -> list[str]:
        with self._lock:
            return [u for u in self.urls if self.members[u].live]

    def order(self) -> list[str]:
        """The live members, starting with the next one in turn (the rest are fail-over)."""
        with self._lock:
            live = [u for u in self.urls if self.members[u].live]
            i = self._turn % max(1, len(live))
            self._turn += 1
        return live[i:] + live[:i]

    def begin(self, url: str, failover: bool = False) -> bool:
        """Count a request about to go to `url` (`failover`: it failed on another member first);
        False, and nothing counted, if `url` was taken out since the order was drawn, so no
        request reaches a member after it is out."""
        with self._lock:
            m = self.members[url]
            if not m.live:
                return False
            m.sent += 1
            m.in_flight += 1
            self.failovers += failover
            return True

    def end(self, url: str, answered: bool) -> None:
        with self._lock:
            m = self.members[url]
            m.in_flight -= 1
            m.answered += answered
            m.failed += not answered

    def take_out(self, url: str, error: str) -> ServerFailure | None:
        """Stop using `url`; the failure record, or None if it was already out."""
        with self._lock:
            m = self.members[url]
            if not m.live:
                return None
            m.live = False
            failure = ServerFailure(url, error, time.time(), m.in_flight, m.sent)
            self.failures.append(failure)
        live = self.live
        log.warning("vLLM server %s taken out of the pool (%d request(s) in flight go to the others): %s; live: %s",
                    url, failure.in_flight, error, live or "none")
        return failure

    def rejoin(self, url: str) -> None:
        with self._lock:
            self.members[url].live = True
        log.info("vLLM server %s is back in the pool", url)

    def record(self) -> dict:
        """The pool for metadata: members, live ones, requests per member, fail-overs, failures."""
        with self._lock:
            return {
                "servers": list(self.urls),
                "live": [u for u in self.urls if self.members[u].live],
                "requests": {u: self.members[u].sent for u in self.urls},
                "failovers": self.failovers,
                "failed_servers": [asdict(f) for f in self.failures],
            }


class ServerEngine(RolloutEngine):
    """Client of a pool of vLLM servers. `restart` (optional) brings dead servers back, e.g. the
    supervisor starting the local ones again; they are refit before they rejoin the pool."""

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
        # Where the weights the pool holds are (load_weights sets it): a member that rejoins is refit from it.
        self.weights_dir: Path | None = None
        self._connect()
        if policy_version is not None:
            self._set_version(policy_version)
        # The version the pool holds, which a member must hold again before it rejoins.
        self._version = policy_version if policy_version is not None else self.policy_version

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

    def _probe(self, url: str) -> tuple[str, int]:
        """The model a server serves and its max_model_len (0 when it does not say); EngineFailure
        when it does not answer, EngineStartError when it lacks the refit and version endpoints."""
        models = self._call("GET", f"{url}/v1/models", timeout=10.0)
        try:
            self._call("GET", f"{url}/weight_info", timeout=10.0)
        except _HttpError as e:
            raise EngineStartError(
                f"vLLM server at {url} has no /weight_info ({e}): start it with VLLM_SERVER_DEV_MODE=1 "
                "(ops.serving.vllm_server does) so refit and version checks work"
            ) from None
        card = models["data"][0]
        return card["id"], int(card.get("max_model_len") or 0)

    def _connect(self) -> None:
        """Check every member; one that does not answer starts out of the pool (at least one must answer)."""
        self.model, lens = None, []
        for url in self.router.urls:
            try:
                model, max_len = self._probe(url)
            except EngineFailure as e:
                self.router.take_out(url, str(e))
                continue
            except _HttpError as e:
                raise EngineStartError(f"vLLM server at {url} refused the client: {e}") from None
            if self.model is not None and model != self.model:
                raise EngineStartError(f"servers serve different models: {self.model!r} and {model!r}")
            self.model = model
            lens.append(max_len)
        if self.model is None:
            raise EngineStartError("no vLLM server answers at " + "; ".join(
                f"{f.url}: {f.error}" for f in self.router.failures))
        # A server that does not say (another OpenAI-compatible server) rejects what is too long itself.
        self._max_model_len = min(lens) if all(lens) else 2**31

    def _member_failed(self, url: str, error: str) -> bool:
        """Take `url` out of the pool when it is down (its /health does not answer either): a
        refused or reset connection, or a server that hangs. True if it is out. A server that
        still answers /health keeps its place (a dropped keep-alive connection is not a crash)."""
        try:
            self._call("GET", f"{url}/health", timeout=2.0)
            return False
        except (EngineFailure, _HttpError):
            self.router.take_out(url, error)
            return True

    # ---- the contract -----------------------------------------------------------------------

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def failed_servers(self) -> list[ServerFailure]:
        """The members taken out of the pool so far, in order (a member that rejoined stays listed)."""
        return list(self.router.failures)

    def pool_record(self) -> dict:
        """The pool for stage metadata: members, live ones, requests per member, fail-overs, failures."""
        return self.router.record()

    @property
    def policy_version(self) -> int | None:
        """The version every live server reports; None if any is unlabelled, they disagree or none is
        live. A member found down here is taken out, so one dead server does not make it unknown."""
        versions = set()
        for url in self.router.live:
            try:
                versions.add(self._served_version(url))
            except EngineFailure as e:
                if self._member_failed(url, str(e)):
                    continue
                return None
            except (_HttpError, KeyError, TypeError):
                return None
        return versions.pop() if len(versions) == 1 else None

    def check_version(self, require_version: int | None) -> int:
        """As the base class; with every member of the pool down it is an EngineFailure, so the
        restart path runs instead of an 'unknown version' error."""
        try:
            return super().check_version(require_version)
        except PolicyVersionError:
            if not self.router.live:
                raise EngineFailure(self._all_out()) from None
            raise

    def _all_out(self) -> str:
        latest = {f.url: f.error for f in self.router.failures}
        live = self.router.live
        return "every vLLM server of the pool is down: " + "; ".join(
            f"{u}: {latest.get(u, 'not answering')}" for u in self.router.urls if u not in live)

    def _served_version(self, url: str) -> int | None:
        return parse_weight_version(self._call("GET", f"{url}/weight_info", timeout=10.0)["weight_version"])

    def _label(self, url: str, version: int | None) -> None:
        label = "unknown" if version is None else str(version)
        self._call("POST", f"{url}/update_weight_version", json={"new_version": label})

    def _set_version(self, version: int | None) -> None:
        for url in self.router.live:
            self._label(url, version)

    def _generate(self, requests: list[TurnRequest]) -> list[TurnResult]:
        before = self.policy_version
        results = list(self._pool.map(self._one, requests))
        after = self.policy_version  # over the members still live: one that died is not asked
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
        """One request on the next live member; on no answer (or a 5xx) the next member takes it."""
        body, last = self._payload(r), None
        for url in self.router.order():
            if not self.router.begin(url, failover=last is not None):
                continue  # taken out since the order was drawn
            try:
                resp = self._call("POST", f"{url}/v1/completions", json=body, timeout=self.request_timeout_s)
            except EngineFailure as e:  # no answer: try the next server
                self._member_failed(url, str(e))  # before `end`: the failure counts this request in flight
                self.router.end(url, answered=False)
                last = e
                continue
            except _HttpError as e:
                self.router.end(url, answered=True)
                if e.status >= 500:
                    last = EngineFailure(f"{url}: {e}")
                    continue
                return TurnResult([], [], "error", None, error=f"{url} rejected the request: {e}")
            self.router.end(url, answered=True)
            return parse_completion(resp)
        raise last or EngineFailure(self._all_out())

    def _restart(self) -> None:
        """Every live member failed a request: run the restart hook, then bring members back
        (each refit first) until one is live, for up to two minutes."""
        if self._restart_hook is not None:
            self._restart_hook()
        deadline = time.monotonic() + 120.0
        while True:
            for url in self.router.urls:
                if url not in self.router.live:
                    self._rejoin(url)
            if self.router.live:
                return
            if time.monotonic() > deadline:
                raise EngineStartError(f"no vLLM server of the pool came back in 120 s; {self._all_out()}")
            time.sleep(2.0)

    def _rejoin(self, url: str) -> bool:
        """Put a member that was taken out back once it answers, serves the pool's model, has been
        refit to the pool's weights (when this engine refit them) and reports the pool's version."""
        try:
            model, _ = self._probe(url)
            if model != self.model:
                log.warning("vLLM server %s serves %r, the pool %r: it stays out", url, model, self.model)
                return False
            if self.weights_dir is not None:
                self._refit_member(url, self.weights_dir)
                self._label(url, self._version)
            served = self._served_version(url)
        except (EngineFailure, EngineStartError, _HttpError, KeyError, TypeError):
            return False
        if served is None or served != self._version:
            log.warning("vLLM server %s holds policy version %s, the pool %s: it stays out", url, served, self._version)
            return False
        self.router.rejoin(url)
        return True

    def _refit_member(self, url: str, model_dir: Path) -> None:
        """Load `model_dir` into one server in place: pause (in-flight requests finish), reload,
        drop the prefix cache (no KV of the old weights is reused), resume."""
        self._call("POST", f"{url}/pause", params={"mode": "wait"}, timeout=600.0)
        try:
            self._call(
                "POST", f"{url}/collective_rpc", timeout=600.0,
                json={"method": self.refit_method, "kwargs": {"weights_path": str(model_dir)}},
            )  # fmt: skip
            self._call("POST", f"{url}/reset_prefix_cache")
        finally:
            self._call("POST", f"{url}/resume")

    def _load_weights(self, model_dir: Path, version: int) -> None:
        """Refit every member, those taken out included (each that answers and is refit rejoins);
        one that does not answer is left out. The version is unknown until all are refit."""
        self._version = None
        reached = []
        for url in self.router.urls:  # unknown until every server holds the new weights
            try:
                self._label(url, None)
                reached.append(url)
            except EngineFailure as e:
                self._member_failed(url, f"refit: {e}")
            except _HttpError as e:
                raise RefitError(f"refit of {url} to {model_dir} failed: {e}") from e
        refit = []
        for url in reached:
            try:
                self._refit_member(url, model_dir)
                self._label(url, version)
                refit.append(url)
            except EngineFailure as e:
                if not self._member_failed(url, f"refit: {e}"):
                    raise RefitError(f"refit of {url} to {model_dir} failed: {e}") from e
            except _HttpError as e:
                raise RefitError(f"refit of {url} to {model_dir} failed: {e}") from e
        if not refit:
            raise RefitError(f"refit to {model_dir} failed: {self._all_out()}")
        for url in refit:
            if url not in self.router.live:
                self.router.rejoin(url)
        self._version, self.weights_dir = version, model_dir

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
