"""Turn a request's engine outputs into the output arrays of its Triton responses.

`ResponseAssembler` follows one request. Streaming, every engine output becomes one response holding the
text and token ids committed since the last one. Not streaming, outputs are gathered and a single response
is made when the request finishes (the generate endpoint needs exactly one). The last response also
carries the `return_*` outputs that the client asked for. `output_ids` holds generated tokens only.

Arrays carry the batch dimension of a batched model: a string output has shape [1, 1].
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from .request_parsing import ParsedRequest

if TYPE_CHECKING:
    from .. import StepOutput


@dataclass
class ResponseAssembler:
    request: ParsedRequest
    # The prompt as text, prepended to a non-streamed `text_output` unless `exclude_input_in_output`. A call,
    # so that token-id prompts are decoded only when needed, and only once the engine has accepted them.
    prompt_text: Callable[[], str]
    _text: list[str] = field(default_factory=list)  # gathered deltas of a non-streamed request
    _token_ids: list[int] = field(default_factory=list)

    def add(self, output: StepOutput) -> dict[str, np.ndarray] | None:
        """The arrays of the response to send for this engine output, or None when nothing is due yet."""
        if self.request.stream:
            return self._arrays(output.text, output.token_ids, output)
        self._text.append(output.text)
        self._token_ids.extend(output.token_ids)
        if not output.finished:
            return None
        text = "".join(self._text)
        if not self.request.exclude_input_in_output:
            text = self.prompt_text() + text
        return self._arrays(text, self._token_ids, output)

    def _arrays(self, text: str, token_ids: list[int], output: StepOutput) -> dict[str, np.ndarray]:
        arrays = {
            "text_output": np.array([[text.encode("utf-8")]], dtype=np.object_),
            "output_ids": np.array([token_ids], dtype=np.int32).reshape(1, len(token_ids)),
        }
        if not output.finished:
            return arrays
        if self.request.return_finish_reason:
            reason = output.finish_reason.value if output.finish_reason is not None else ""
            arrays["finish_reason"] = np.array([[reason.encode("utf-8")]], dtype=np.object_)
        if self.request.return_num_input_tokens:
            arrays["num_input_tokens"] = np.array([[output.num_prompt_tokens]], dtype=np.uint32)
        if self.request.return_num_output_tokens:
            arrays["num_output_tokens"] = np.array([[output.num_output_tokens]], dtype=np.uint32)
        if self.request.return_nfe:
            arrays["nfe"] = np.array([[output.nfe]], dtype=np.uint32)
        return arrays
