"""The two ways to reach Triton, and the address each one listens on by default."""

import enum


class Protocol(enum.Enum):
    GRPC = "grpc"
    HTTP = "http"

    @property
    def default_url(self) -> str:
        return {Protocol.GRPC: "localhost:8001", Protocol.HTTP: "localhost:8000"}[self]
