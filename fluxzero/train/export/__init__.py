"""Export: a checkpoint of any ZeRO stage consolidated into one state dict (consolidate.py), written as FLUX.1
weights (full.py) or as a LoRA adapter (lora.py)."""
