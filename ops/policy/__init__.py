"""The policy itself (asset base_policy): the megatron-core MoE model, its CPU adaptations, tokenizer,
checkpoints, HF conversion, policy versions, bootstrap SFT and parity."""
