"""The training step's techniques, shared by the trace, the probes and the trainer."""
