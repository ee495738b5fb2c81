"""A scripted rollout engine for narrow tests of the episode loop and the samplers: each turn is
answered by a Python function of the prompt text, tokenized like a model's output would be.

Imported as `scripted_engine` (pytest puts tests/ on sys.path: it has no __init__.py). The real
vLLM engines are tested in test_rollout_offline.py and test_rollout_server.py.
"""

from __future__ import annotations

from ops.rollout.engine import EngineFailure, RetryPolicy, RolloutEngine, TurnRequest, TurnResult


class ScriptedEngine(RolloutEngine):
    """Answers each turn with `script(prompt_text, request)` -> text, tokenized like a model would.

    The text is cut at the first stop token (kept, as vLLM keeps it) or at max_tokens.
    """

    def __init__(self, tokenizer, script, version=3, fail_times=0, max_len=256):
        super().__init__(RetryPolicy(max_retries=2, timeout_s=None))
        self.tok, self.script, self.version, self.fail_times, self.max_len = tokenizer, script, version, fail_times, max_len
        self.calls: list[list[TurnRequest]] = []
        self.restarts = 0

    def _generate(self, requests):
        if self.fail_times:
            self.fail_times -= 1
            raise EngineFailure("scripted crash")
        self.calls.append(requests)
        out = []
        for r in requests:
            text = self.script(self.tok.decode(r.prompt_ids, skip_special_tokens=True), r)
            if text is None:
                out.append(TurnResult([], [], "error", None, error="rejected"))
                continue
            ids = self.tok.encode(text, add_special_tokens=False)
            cut = next((i + 1 for i, t in enumerate(ids) if t in r.stop_token_ids), None)
            ids = ids[:cut] if cut else ids
            finish = "stop" if cut and cut <= r.max_tokens else "length"
            ids = ids[: r.max_tokens]
            out.append(TurnResult(ids, [-0.5] * len(ids), finish, self.version))
        return out

    def _restart(self):
        self.restarts += 1

    def _load_weights(self, model_dir, version):
        self.version = version

    @property
    def policy_version(self):
        return self.version

    @property
    def max_model_len(self):
        return self.max_len
