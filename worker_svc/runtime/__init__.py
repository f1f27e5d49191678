"""Turning step plans into steps: the persistent batch that mirrors the scheduler's state (numpy, no torch),
the ModelRunner, decode steps in CUDA graphs, the sampler, tensor-parallel ranks, and a simulated runner.
Importing this package imports no torch: the batch and the simulated runner serve CPU-only callers."""
