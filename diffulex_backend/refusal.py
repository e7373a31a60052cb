"""The error a request gets when it cannot be served as sent."""


class Refusal(ValueError):
    """A request the engine cannot serve as sent. The message goes back to the client; `field` names what it got
    wrong (a sampling parameter, an input, or "prompt"), for the refusal counter and the log."""

    def __init__(self, message: str, field: str = "request"):
        super().__init__(message)
        self.field = field
