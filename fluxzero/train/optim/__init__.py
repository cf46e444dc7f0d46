"""Optimizers of the memory-saving modes: the builder and its optimizers (optimizers.py), the fused step applied
during backward (fused_step.py), the host AdamW of the offloaded modes (host.py), keyed stochastic rounding
(rounding.py) and the state layout they share (state.py)."""
