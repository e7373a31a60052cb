"""OpenAI's error body, `{"error": {"message", "type", "param", "code"}}`, and the exception that carries one.

Every error the front answers, whatever raised it, goes through `error_body`, so clients (the openai SDKs among
them) read the same shape from a refused field, a bad key, an oversized body or a model that is not ready.
"""

from __future__ import annotations

from http import HTTPStatus

from fastapi.responses import JSONResponse

# The `type` OpenAI gives each status class.
ERROR_TYPES = {
    HTTPStatus.BAD_REQUEST: "invalid_request_error",
    HTTPStatus.UNAUTHORIZED: "authentication_error",
    HTTPStatus.NOT_FOUND: "invalid_request_error",
    HTTPStatus.METHOD_NOT_ALLOWED: "invalid_request_error",
    HTTPStatus.REQUEST_ENTITY_TOO_LARGE: "invalid_request_error",
    HTTPStatus.UNPROCESSABLE_ENTITY: "invalid_request_error",
    HTTPStatus.INTERNAL_SERVER_ERROR: "server_error",
    HTTPStatus.SERVICE_UNAVAILABLE: "service_unavailable",
}


def error_body(message: str, status: HTTPStatus, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "server_error"), "param": param,
                      "code": code}}


class OpenAIError(Exception):
    """A request that ends with an error response: its status, message, the field at fault and a code."""

    def __init__(self, status: HTTPStatus, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict:
        return error_body(self.message, self.status, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(HTTPStatus.BAD_REQUEST, message, param, code)


def unavailable(message: str) -> OpenAIError:
    return OpenAIError(HTTPStatus.SERVICE_UNAVAILABLE, message, code="model_not_ready")
