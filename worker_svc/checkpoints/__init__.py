"""Writes random-weight checkpoints in the exact Hugging Face layout (named presets, the real Qwen tokenizer):
what tests and demos serve, since no model hub is reachable. `python -m worker_svc.checkpoints`, or
`splitserve-worker make-model`."""
