"""Where a served request's responses go, and the words for how one ends badly: shared by the engine loop's two
threads and the adapter that hands them Triton's response senders."""
from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from ..output import StepOutput


class ErrorKind(enum.Enum):
    INVALID_ARG = enum.auto()
    CANCELLED = enum.auto()
    INTERNAL = enum.auto()
    UNAVAILABLE = enum.auto()


class FailureCause(enum.Enum):
    ENGINE = "engine_failure"  # engine.step_deltas() or engine.abort() raised
    THREAD_DEATH = "thread_death"  # a thread of the loop ended without being told to


class ResponseStream(Protocol):
    """Where one request's responses go (a Triton response sender inside the server)."""

    def is_cancelled(self) -> bool: ...

    def send_output(self, output: StepOutput) -> None:
        """Send what this engine output is due; the output's `finished` flag makes it the final response."""

    def send_error(self, kind: ErrorKind, message: str) -> None:
        """Send an error as the final response."""
