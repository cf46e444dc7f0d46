"""Where the ranks run: hostfiles, launcher command lines, NCCL profiles, doctor (pure Python)."""
