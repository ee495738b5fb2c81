"""Multi-turn tool episodes of an environment (ops/envs), token-in/token-out.

One episode: the prompt line, then model turns, each one line (in the calculator world
`CALL calc(...)` or `ANSWER n`), parsed by the environment; after a tool call the environment
runs the tool and appends its result line (`RESULT ...`). Every live episode's next turn goes
into one engine call, so the engine batches them.

Token-exact by construction: the next turn's prompt is the previous prompt ids plus the
sampled ids plus the tool line's ids (tokenized on its own, no special tokens). Model output is
never decoded and re-encoded; text is decoded only to parse an action. The newline is a token
of its own (ops.policy.tokenizer), so a turn ends exactly at it (a stop token).

An episode ends with finish_reason
    answer          an ANSWER line (the answer may still be wrong: the verifier decides)
    invalid_action  a line that is neither action, or an end-of-sequence before an action
    max_turns       the environment's `max_turns` model turns without an answer
    max_tokens      the completion token budget (or the engine's context) ran out
    env_error       the environment broke (the tool raised unexpectedly, a prompt the engine
                    cannot take); `error` says how
    engine_error    the engine rejected this one request; `error` says how
Nothing is dropped: a broken episode is recorded with its reason and the tokens it had.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from ops.envs import Action, Environment, get_environment
from ops.tasks.task_world import Task
from ops.rollout.engine import RolloutEngine, TurnRequest, TurnResult
from ops.policy.tokenizer import newline_id


@dataclass
class ToolCallRecord:
    expression: str  # the call's argument
    result: str | None  # the tool's value, None when it reported an error
    error: str | None
    tool: str = "calc"


@dataclass
class Episode:
    """An episode in progress or done. The three per-token lists always have equal length."""

    task: Task
    sample_index: int
    seed: int
    prompt_ids: list[int]
    prompt_text: str
    completion_ids: list[int] = field(default_factory=list)
    behaviour_logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    text_pieces: list[str] = field(default_factory=list)
    turns: int = 0
    tool_calls: list[ToolCallRecord] = field(default_factory=list)
    actions: list[Action] = field(default_factory=list)  # the tool calls as parsed (the tools' episode state)
    model_lines: list[str] = field(default_factory=list)
    final_answer: str | None = None
    finish_reason: str | None = None
    error: str | None = None
    policy_version: int | None = None
    generation_seconds: float = 0.0
    source: str = "policy"  # "reference": the task's solution, written rather than sampled

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def completion_text(self) -> str:
        return "".join(self.text_pieces)

    @property
    def completion_tokens(self) -> int:
        return sum(self.loss_mask)

    def finish(self, reason: str, error: str | None = None) -> None:
        self.finish_reason, self.error = reason, error

    def append(self, ids: list[int], logprobs: list[float], trained: bool, text: str) -> None:
        self.completion_ids += ids
        self.behaviour_logprobs += logprobs if trained else [0.0] * len(ids)
        self.loss_mask += [1 if trained else 0] * len(ids)
        self.text_pieces.append(text)


@dataclass(frozen=True)
class EpisodeConfig:
    """Sampling of one episode; `max_tokens` bounds all completion tokens (model + tool)."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 96


def turn_seed(sample_seed: int, turn: int) -> int:
    """A turn's sampling seed: turns of one episode differ, and replays reproduce them."""
    digest = hashlib.sha256(f"{sample_seed}:turn:{turn}".encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


class EpisodeRunner:
    """Runs batches of episodes of one environment against one engine and one tokenizer."""

    def __init__(self, engine: RolloutEngine, tokenizer, env: Environment | None = None) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.env = env or get_environment()
        self.newline = newline_id(tokenizer)
        self.eos = tokenizer.eos_token_id
        self.stop_ids = tuple(t for t in (self.newline, self.eos) if t is not None)

    def new_episode(self, task: Task, sample_index: int, seed: int) -> Episode:
        text = self.env.prompt_text(task)
        return Episode(task, sample_index, seed, self.tokenizer.encode(text), text)

    def reference_episode(self, task: Task, sample_index: int, policy_version: int | None,
                          settings: EpisodeConfig) -> Episode:
        """The task's known solution as an episode: its model lines are written, not sampled (behaviour
        log-probs 0.0, `source` "reference"), and the tool lines come from the environment's tool as
        in a sampled episode, so the verifier judges it like any other. Each model line is tokenized
        on its own, ending with the newline token, as the policy would emit it."""
        ep = self.new_episode(task, sample_index, seed=0)
        ep.source, ep.policy_version = "reference", policy_version
        for role, text in self.env.solution_turns(task):
            if role != "model":
                continue  # the tool answers the CALL line itself (below)
            line = text.rstrip("\n")
            ids = self.tokenizer.encode(line, add_special_tokens=False) + [self.newline]
            ep.append(ids, [0.0] * len(ids), True, line + "\n")
            ep.turns += 1
            ep.model_lines.append(line)
            action = self.env.parse_action(line)
            if action.kind == "answer":
                ep.final_answer = action.argument
                ep.finish("answer")
                break
            if action.kind == "call":
                self._call_tool(ep, action, settings)
                if ep.done:
                    break
        if not ep.done:
            ep.finish("env_error", f"the reference solution of task {task.task_id} gives no answer")
        return ep

    def run(self, episodes: list[Episode], settings: EpisodeConfig, require_version: int | None = None) -> list[Episode]:
        """Advance every episode to its end, one batched engine call per turn."""
        live = [ep for ep in episodes if not ep.done]
        while live:
            requests, waiting = [], []
            for ep in live:
                req = self._next_request(ep, settings)
                if req is not None:
                    requests.append(req)
                    waiting.append(ep)
            start = time.monotonic()
            results = self.engine.generate_turns(requests, require_version=require_version)
            seconds = time.monotonic() - start
            for ep, res in zip(waiting, results):
                ep.generation_seconds += seconds
                self._apply(ep, res, settings)
            live = [ep for ep in live if not ep.done]
        return episodes

    def _next_request(self, ep: Episode, settings: EpisodeConfig) -> TurnRequest | None:
        if ep.turns >= self.env.max_turns:
            ep.finish("max_turns")
            return None
        context = len(ep.prompt_ids) + len(ep.completion_ids)
        budget = min(settings.max_tokens - len(ep.completion_ids), self.engine.max_model_len - context)
        if budget < 1:
            if not ep.completion_ids and context >= self.engine.max_model_len:
                ep.finish("env_error", f"prompt of {context} tokens does not fit the engine's "
                                       f"max_model_len {self.engine.max_model_len}")
            else:
                ep.finish("max_tokens")
            return None
        return TurnRequest(
            prompt_ids=ep.prompt_ids + ep.completion_ids, max_tokens=budget, temperature=settings.temperature,
            top_p=settings.top_p, seed=turn_seed(ep.seed, ep.turns), stop_token_ids=self.stop_ids,
        )  # fmt: skip

    def _apply(self, ep: Episode, res: TurnResult, settings: EpisodeConfig) -> None:
        if res.finish_reason == "error":
            ep.finish("engine_error", res.error or "the engine rejected the request")
            return
        if ep.policy_version is None:
            ep.policy_version = res.policy_version
        elif res.policy_version != ep.policy_version:
            # The weights changed between turns of one episode: its tokens come from two policies.
            ep.finish("env_error", f"policy version changed mid-episode ({ep.policy_version} -> {res.policy_version})")
            return
        ids = list(res.token_ids)
        ended_by = ids[-1] if ids and ids[-1] in self.stop_ids else None
        body = ids[:-1] if ended_by is not None else ids
        line = self.tokenizer.decode(body, skip_special_tokens=False)
        text = line + ("\n" if ended_by == self.newline else "")
        ep.append(ids, list(res.logprobs), True, text)
        ep.turns += 1
        ep.model_lines.append(line)
        if ended_by is None:  # ran out of tokens mid-line
            ep.finish("max_tokens")
            return
        action = self.env.parse_action(line)
        if action.kind == "answer":
            ep.final_answer = action.argument
            ep.finish("answer")
        elif action.kind == "invalid" or ended_by == self.eos:
            ep.finish("invalid_action")
        else:
            self._call_tool(ep, action, settings)

    def _call_tool(self, ep: Episode, action: Action, settings: EpisodeConfig) -> None:
        prefix, expression = self.env.result_prefix, action.argument
        try:
            result_line = self.env.run_tool(ep.task, action, list(ep.actions))
            if not (result_line.startswith(prefix) and result_line.endswith("\n") and result_line.count("\n") == 1):
                raise ValueError(f"tool returned a malformed line {result_line!r}")
            ids = self.tokenizer.encode(result_line, add_special_tokens=False)
        except Exception as e:  # noqa: BLE001 - a broken environment is recorded, not raised
            ep.tool_calls.append(ToolCallRecord(expression, None, f"{type(e).__name__}: {e}", action.tool))
            ep.finish("env_error", f"tool raised {type(e).__name__}: {e}")
            return
        value = result_line[len(prefix) : -1]
        failed = value.startswith("error: ")
        ep.tool_calls.append(ToolCallRecord(expression, None if failed else value, value[7:] if failed else None, action.tool))
        ep.actions.append(action)
        context = len(ep.prompt_ids) + len(ep.completion_ids) + len(ids)
        if len(ep.completion_ids) + len(ids) > settings.max_tokens or context > self.engine.max_model_len:
            ep.finish("max_tokens")  # the tool line would not fit: stop before it, tokens stay exact
            return
        ep.append(ids, [0.0] * len(ids), False, result_line)
