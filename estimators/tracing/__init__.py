"""Recording one training step on fake (or real) tensors: every allocation and op."""
