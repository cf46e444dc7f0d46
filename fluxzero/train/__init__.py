"""Training: loop, public train step, DeepSpeed engine (with its patches, activation checkpointing and FP8 applied
from outside the model), checkpoints, export, flow-matching objective, metrics."""
