"""The DeepSpeed config, pure Python (never imports deepspeed at module level): gen-config's builder (build.py),
the checker of any config dict (check.py), THE parsed view everything else reads (view.py), reading a JSON file
(file.py), DeepSpeed's own parser run without a GPU (validate.py) and the Adam(W) implementation table
(adam_impl.py)."""
