"""What goes to the diffulex model and what comes back, independent of protocol.

A `GenerateRequest` is encoded either as gRPC input tensors or as the JSON body of the HTTP generate
extension. Every response of the model decodes to a `ModelResponse`: a text delta, and on the last response
the request's totals. `Completion` is what a whole request adds up to.

The client always asks for the totals and always excludes the prompt from the output, so that a
non-streamed text equals the concatenated deltas of a streamed one.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

import numpy as np
import tritonclient.grpc as grpcclient

# Boolean inputs sent with every request; `stream` is added per request.
FIXED_FLAGS = {
    "exclude_input_in_output": True,
    "return_finish_reason": True,
    "return_num_input_tokens": True,
    "return_num_output_tokens": True,
    "return_nfe": True,
}
OUTPUT_NAMES = ("text_output", "finish_reason", "num_input_tokens", "num_output_tokens", "nfe", "output_ids",
                "log_probs", "top_log_probs", "top_log_prob_ids")
TOTAL_NAMES = ("num_input_tokens", "num_output_tokens", "nfe")


@dataclass(frozen=True)
class GenerateRequest:
    prompt: str
    sampling: dict = field(default_factory=dict)  # the model's sampling parameters, sent as one JSON object
    stream: bool = False

    def flags(self) -> dict[str, bool]:
        return {"stream": self.stream, **FIXED_FLAGS}

    def grpc_inputs(self) -> list[grpcclient.InferInput]:
        """The input tensors, each [1, 1]: the model batches, so every input has a batch dimension."""
        tensors = [
            _tensor("text_input", "BYTES", np.array([[self.prompt.encode("utf-8")]], dtype=np.object_)),
            _tensor("sampling_parameters", "BYTES",
                    np.array([[json.dumps(self.sampling).encode("utf-8")]], dtype=np.object_)),
        ]
        tensors += [_tensor(name, "BOOL", np.array([[value]], dtype=np.bool_)) for name, value in self.flags().items()]
        return tensors

    def generate_body(self) -> dict:
        """The JSON body for the HTTP generate extension: top-level keys that name inputs become tensors."""
        return {"text_input": self.prompt, "sampling_parameters": json.dumps(self.sampling), **self.flags()}


@dataclass(frozen=True)
class ModelResponse:
    """One response of the model. Only the final one carries `finish_reason` and the totals."""

    text: str
    finish_reason: str | None = None
    num_input_tokens: int | None = None
    num_output_tokens: int | None = None
    nfe: int | None = None
    # The response's tokens, and where the request asked for them their log-probabilities (see the model's
    # config.pbtxt): each token's, and the most likely tokens at its position as (id, log-probability) pairs.
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[float, ...] | None = None
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] | None = None

    @property
    def is_final(self) -> bool:
        return self.finish_reason is not None

    @classmethod
    def from_grpc(cls, result) -> ModelResponse:
        """From a tritonclient.grpc InferResult; absent outputs decode to None."""
        def scalar(name):
            array = result.as_numpy(name)
            return None if array is None else array.reshape(-1)[0]

        def flat(name):
            array = result.as_numpy(name)
            return None if array is None else array.reshape(-1).tolist()

        reason = scalar("finish_reason")
        totals = {name: scalar(name) for name in TOTAL_NAMES}
        logprobs, top_ids, top_logprobs = flat("log_probs"), result.as_numpy("top_log_prob_ids"), \
            result.as_numpy("top_log_probs")
        top = None
        if top_ids is not None and top_logprobs is not None:  # [1, tokens, k]
            top = tuple(tuple(zip(ids, values)) for ids, values in zip(top_ids[0].tolist(), top_logprobs[0].tolist()))
        return cls(
            text=(scalar("text_output") or b"").decode("utf-8"),
            finish_reason=None if reason is None else reason.decode("utf-8"),
            **{name: None if value is None else int(value) for name, value in totals.items()},
            token_ids=tuple(flat("output_ids") or ()), logprobs=None if logprobs is None else tuple(logprobs),
            top_logprobs=top,
        )

    @classmethod
    def from_json(cls, body: dict) -> ModelResponse:
        """From one generate-extension JSON object (a /generate body or one generate_stream event)."""
        return cls(text=body.get("text_output", ""), finish_reason=body.get("finish_reason"),
                   **{name: body.get(name) for name in TOTAL_NAMES})


@dataclass(frozen=True)
class Completion:
    text: str
    finish_reason: str
    num_input_tokens: int
    num_output_tokens: int
    nfe: int  # forward passes the engine ran for this request

    @classmethod
    def from_responses(cls, texts: Iterable[str], final: ModelResponse) -> Completion:
        return cls(text="".join(texts), finish_reason=final.finish_reason, num_input_tokens=final.num_input_tokens,
                   num_output_tokens=final.num_output_tokens, nfe=final.nfe)

    def to_dict(self) -> dict:
        return asdict(self)


def _tensor(name: str, datatype: str, array: np.ndarray) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array)
    return tensor
