"""A Python client for the diffulex model served by Triton Inference Server, over gRPC or HTTP."""

from .client import AsyncDiffulexClient, DiffulexClient
from .errors import DiffulexConnectionError, DiffulexError, DiffulexServerError, DiffulexTimeoutError
from .health import ServerHealth
from .messages import Completion
from .protocol import Protocol
from .streams import AsyncCompletionStream, CompletionStream

__all__ = [
    "AsyncCompletionStream",
    "AsyncDiffulexClient",
    "Completion",
    "CompletionStream",
    "DiffulexClient",
    "DiffulexConnectionError",
    "DiffulexError",
    "DiffulexServerError",
    "DiffulexTimeoutError",
    "Protocol",
    "ServerHealth",
]
