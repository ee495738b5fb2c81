"""The learner: one GRPO-family RL step of the megatron-core MoE policy on a verified batch.

- `config`: `LearnerConfig` (the algorithm) and `LearnerJob` (one run of the learner process);
- `batch`: rollouts + rewards -> training samples with advantages (dynamic sampling counted);
- `advantages`, `loss`: group-relative advantages and the clipped surrogate (plain torch);
- `step`: `Learner`, the micro-batched updates, with `micro_batches` (the per-rank split),
  `optimizer` (megatron's on CUDA, torch AdamW over main_grad on CPU), `moe_stats` (router
  balance, load-balancing loss) and `metrics` (per-update metrics reduced over ranks);
- `job`: one step of the process: restore, train, checkpoint, HF export (`export`), MLflow;
- `main`: the process entry (`python -m ops.learn.main --config JOB.json`, under torchrun, in
  the `world` it sets up), Dagster Pipes report.
"""
