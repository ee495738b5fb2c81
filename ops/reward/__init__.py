"""Stage `reward` (asset verified_rewards): sandboxed verifiers and the scoring of a cycle's rollouts."""
