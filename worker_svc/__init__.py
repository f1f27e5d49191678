"""The GPU worker: owns the weights, the KV tensors and the kernels, and runs the scheduler's step plans.

Rooms, bottom up: kernels/ (every op with a fast variant, picked once), model/ (the architectures and their
layers), runtime/ (plans into steps: the persistent batch, the ModelRunner, CUDA graphs, sampling, tensor
parallelism), service/ (the gRPC service), and apart from them checkpoints/ (the random-weight checkpoint
writer). cli.py is `splitserve-worker`."""
