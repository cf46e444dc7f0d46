"""Checkpoints: save, load and prune (store.py), what a step folder must hold (integrity.py), the one resume
decision (resume.py), which globals a saved file may name (safe_files.py), and the output-folder locks (locks.py)."""
