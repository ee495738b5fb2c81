"""Stage `reward` (asset verified_rewards): sandboxed verifiers and the scoring of a cycle's rollouts.

- `scoring`: every rollout of a cycle through its verifier, in parallel, into reward rows;
- `verifiers`: the verifier registry and the built-in verifiers (calculator, answers, swe);
- `sandbox`: `Sandbox` and `Workspace`, running untrusted commands, built from `limits`
  (resource limits), `isolation` (bwrap, failing closed without it; the bwrap command line),
  `uid_pool` (a uid per run as root), `process` (run, capture, kill, reap) and `outcome`
  (the typed result).
"""
