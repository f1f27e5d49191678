"""Python client of splitserve (sync and asyncio) and the `splitserve` command line."""

from client.client import AsyncClient, Client, Completion, Delta, Embeddings, Usage

__all__ = ["AsyncClient", "Client", "Completion", "Delta", "Embeddings", "Usage"]
