"""Python client of splitserve (sync and asyncio) and the `splitserve` command line."""

from client.client import AsyncClient, Classifications, Client, Completion, Delta, Embeddings, Usage
from client.scores import Scores

__all__ = ["AsyncClient", "Classifications", "Client", "Completion", "Delta", "Embeddings", "Scores", "Usage"]
