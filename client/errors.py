"""The client's exceptions, and their translation from tritonclient, gRPC and socket errors.

Callers tell three failures apart: the server answered with an error (a bad request, an engine failure),
the server could not be reached, or the request ran past its timeout.
"""

from __future__ import annotations

import grpc
from tritonclient.utils import InferenceServerException


class DiffulexError(Exception):
    """Base of every error this client raises."""


class DiffulexServerError(DiffulexError):
    """The server answered with an error. `message` is the server's own text."""

    def __init__(self, message: str, status: str | None = None):
        super().__init__(message)
        self.message = message
        self.status = status  # e.g. "400" over HTTP or "StatusCode.INTERNAL" over gRPC, when known


class DiffulexConnectionError(DiffulexError):
    """The server could not be reached, or the connection broke."""


class DiffulexTimeoutError(DiffulexError):
    """The request ran past the client's timeout; it is cancelled on the server."""


def from_triton_exception(err: InferenceServerException) -> DiffulexError:
    """tritonclient reports an error the model sent on a stream without a status, and a transport
    failure with its gRPC status code."""
    status = err.status()
    if status == str(grpc.StatusCode.UNAVAILABLE):
        return DiffulexConnectionError(err.message())
    if status == str(grpc.StatusCode.DEADLINE_EXCEEDED):
        return DiffulexTimeoutError(err.message())
    return DiffulexServerError(err.message(), status)


def from_rpc_error(err: grpc.RpcError) -> DiffulexError:
    """From a gRPC error raised by grpc.aio, which tritonclient.grpc.aio lets through while streaming."""
    code, details = err.code(), err.details() or ""
    if code is grpc.StatusCode.UNAVAILABLE:
        return DiffulexConnectionError(details)
    if code is grpc.StatusCode.DEADLINE_EXCEEDED:
        return DiffulexTimeoutError(details)
    return DiffulexServerError(details, str(code))


def from_os_error(err: OSError, url: str) -> DiffulexError:
    """From a socket error of an HTTP request."""
    if isinstance(err, TimeoutError):
        return DiffulexTimeoutError(f"no answer from {url} within the timeout")
    return DiffulexConnectionError(f"cannot reach {url}: {err}")
