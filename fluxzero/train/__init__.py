"""Training: loop, public train step, DeepSpeed engine, checkpoints, export, flow-matching objective, metrics."""
