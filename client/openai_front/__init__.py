"""An OpenAI-compatible HTTP API in front of the diffulex model on Triton, as a process of its own.

It speaks OpenAI over HTTP (FastAPI and uvicorn) and Triton's gRPC stream to the model; it holds the chat template
and nothing else of the model. `create_app(FrontSettings(...))` builds the ASGI app; `diffulex-openai` runs it.
"""

from .app import create_app
from .settings import FrontSettings

__all__ = ["FrontSettings", "create_app"]
