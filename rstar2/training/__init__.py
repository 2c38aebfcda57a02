"""Training: GRPO-RoC (Resample-on-Correct down-sampling, the clipped GRPO loss), the policy trainer and
its data-parallel ranks (torch or DeepSpeed ZeRO), token-sized micro-batches, the optimizer, the
non-reasoning SFT and its transcripts, and the curriculum between stages (transitions, hard-sample
mining)."""
