"""OpenAI-compatible HTTP gateway in front of the scheduler's gRPC API (`splitserve-gateway`).

A separate process that scales on its own: it holds no model and no KV state, only an asyncio gRPC
client (`client.AsyncClient`) of one scheduler address, so any number of gateways can serve one
scheduler (or a load-balanced set of them).
"""
