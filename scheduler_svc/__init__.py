"""The CPU scheduler (no torch): the public gRPC API, the request edge (requests.py), continuous batching
over paged KV blocks with prefix caching, and the membership of the worker groups it drives."""
