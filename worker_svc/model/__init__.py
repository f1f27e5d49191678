"""Models on the paged KV runtime: the config, the layers they compose, tensor-parallel linears, the checkpoint
loader, and one module per architecture."""
