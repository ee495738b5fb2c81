"""The learner: one GRPO-family RL step of the megatron-core MoE policy on a verified batch.

- `config`: `LearnerConfig` (the algorithm) and `LearnerJob` (one run of the learner process);
- `batch`: rollouts + rewards -> training samples with advantages (dynamic sampling counted);
- `step`: `Learner`, megatron DDP + optimizer + micro-batched updates + metrics;
- `main`: the process entry (`python -m ops.learn.main --config JOB.json`, under torchrun),
  checkpoints, HF export, MLflow metrics, Dagster Pipes report.
"""
