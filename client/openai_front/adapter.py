"""An OpenAI request turned into the diffulex model's Triton requests: one per choice.

A completion's prompt (a string, token ids, or a list of either) and a chat's rendered and tokenized
conversation each give one prompt; `n` copies of each go out as n Triton requests, copy i with seed + i (modulo
2^64), and choice `prompt_index * n + i`. The model's inputs follow its config.pbtxt: `text_input` or `input_ids`,
`sampling_parameters` as a JSON string, `stream`, and the flags that make the last response carry the finish
reason and the token counts.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field

import numpy as np
import tritonclient.grpc as grpcclient

from diffulex_backend.serving.request_parsing import MAX_JSON_DEPTH, MAX_PARAMETERS_CHARS, json_depth

from .errors import bad_request
from .refusals import EXTRA_SAMPLING_FIELDS
from .schemas import ChatCompletionRequest, CompletionRequest

SEED_MODULUS = 2**64
MIN_SEED = -(2**63)  # an int64 seed, as OpenAI's clients send, or a uint64 one, as the model takes
MAX_N = 128  # choices per prompt
MAX_PROMPTS = 64  # prompts per completion request
MAX_CHOICES = 256  # Triton requests one OpenAI request may start: prompts times n
ID_DTYPES = {"INT32": np.int32, "INT64": np.int64}
FLAGS = ("return_finish_reason", "return_num_input_tokens", "return_num_output_tokens", "exclude_input_in_output")


@dataclass(frozen=True)
class TritonRequest:
    """One choice's request to the model."""

    index: int  # the choice's index in the OpenAI response
    prompt_index: int
    prompt: str | list[int]
    sampling: dict = field(default_factory=dict)
    stream: bool = False

    def sampling_json(self) -> str:
        return json.dumps(self.sampling)

    def inputs(self, ids_datatype: str = "INT32") -> list[grpcclient.InferInput]:
        """The input tensors, each with the batch dimension of 1 the model's config declares; token ids in the type
        the model declares for `input_ids` (its metadata's datatype, INT32 or INT64)."""
        if isinstance(self.prompt, str):
            tensors = [_tensor("text_input", "BYTES", np.array([[self.prompt.encode("utf-8")]], dtype=np.object_))]
        else:
            ids = np.array([self.prompt], dtype=ID_DTYPES[ids_datatype])
            tensors = [_tensor("input_ids", ids_datatype, ids)]
        tensors.append(_tensor("sampling_parameters", "BYTES",
                               np.array([[self.sampling_json().encode("utf-8")]], dtype=np.object_)))
        tensors += [_tensor(name, "BOOL", np.array([[True]], dtype=np.bool_)) for name in FLAGS]
        tensors.append(_tensor("stream", "BOOL", np.array([[self.stream]], dtype=np.bool_)))
        return tensors


def completion_prompts(request: CompletionRequest) -> list[str | list[int]]:
    """The prompts of a completion request: a string, a list of token ids, or a list of either."""
    prompt = request.prompt
    if isinstance(prompt, str) or (prompt and all(isinstance(token, int) for token in prompt)):
        prompts = [prompt]
    else:
        prompts = list(prompt)
    if not prompts or any(len(p) == 0 for p in prompts):
        raise bad_request("'prompt' must not be empty", param="prompt")
    if len(prompts) > MAX_PROMPTS:
        raise bad_request(f"'prompt' holds {len(prompts)} prompts; at most {MAX_PROMPTS} are accepted",
                          param="prompt")
    for tokens in prompts:
        if not isinstance(tokens, str) and any(not 0 <= token < 2**31 for token in tokens):
            raise bad_request("token ids in 'prompt' must lie in [0, 2^31)", param="prompt")
    return prompts


def sampling_parameters(request: CompletionRequest | ChatCompletionRequest) -> dict:
    """The model's sampling parameters of one copy, less the seed. Absent fields take the model's defaults."""
    values = {}
    max_tokens = getattr(request, "max_completion_tokens", None)
    if max_tokens is None:
        max_tokens = request.max_tokens
    if max_tokens is not None:
        values["max_tokens"] = max_tokens
    for name in ("temperature", "top_p"):
        if getattr(request, name) is not None:
            values[name] = getattr(request, name)
    if request.stop is not None:
        values["stop"] = [request.stop] if isinstance(request.stop, str) else request.stop
    if logprobs_asked(request) is not None:
        values["logprobs"] = logprobs_asked(request)
    extra = request.extra_fields()
    values.update({name: extra[name] for name in EXTRA_SAMPLING_FIELDS if name in extra})
    return values


def logprobs_asked(request: CompletionRequest | ChatCompletionRequest) -> int | None:
    """How many most likely tokens each output token comes with, or None when the request asks for no
    log-probabilities: a completion's `logprobs`, a chat's `top_logprobs` (0 when absent) once `logprobs` is true."""
    if isinstance(request, ChatCompletionRequest):
        return (request.top_logprobs or 0) if request.logprobs else None
    return request.logprobs


def choice_count(request: CompletionRequest | ChatCompletionRequest) -> int:
    n = 1 if request.n is None else request.n
    if not 1 <= n <= MAX_N:
        raise bad_request(f"'n' must be an integer in [1, {MAX_N}], got {n}", param="n")
    return n


def base_seed(request: CompletionRequest | ChatCompletionRequest) -> int:
    """The request's seed as the model takes it; a request without one gets a fresh random seed, so that sampled
    requests (and the n copies of one) differ as OpenAI's do."""
    if request.seed is None:
        return secrets.randbits(64)
    if not MIN_SEED <= request.seed < SEED_MODULUS:
        raise bad_request(f"'seed' must be an integer in [{MIN_SEED}, {SEED_MODULUS - 1}]", param="seed")
    return request.seed % SEED_MODULUS


def triton_requests(request: CompletionRequest | ChatCompletionRequest,
                    prompts: list[str | list[int]]) -> list[TritonRequest]:
    n = choice_count(request)
    if len(prompts) * n > MAX_CHOICES:
        raise bad_request(f"{len(prompts)} prompts times n = {n} asks for {len(prompts) * n} choices; at most "
                          f"{MAX_CHOICES} are accepted", param="n")
    seed = base_seed(request)
    sampling = sampling_parameters(request)
    check_fits_the_model(sampling)
    stream = bool(request.stream)
    return [TritonRequest(index=p * n + i, prompt_index=p, prompt=prompt,
                          sampling={**sampling, "seed": (seed + i) % SEED_MODULUS}, stream=stream)
            for p, prompt in enumerate(prompts) for i in range(n)]


def check_fits_the_model(sampling: dict) -> None:
    """The model takes its sampling parameters as one JSON object of bounded size and depth, measured as the model
    measures them; past either bound this names the field that takes it there, which the model, seeing one input,
    cannot. The largest seed's digits are counted in."""
    for name, value in sampling.items():
        if json_depth(json.dumps({name: value})) > MAX_JSON_DEPTH:
            raise bad_request(f"{name}: nested too deep; the model takes its sampling parameters at most "
                              f"{MAX_JSON_DEPTH} levels deep, the object that holds them included", param=name)
    size = len(json.dumps({**sampling, "seed": SEED_MODULUS - 1}))
    if size > MAX_PARAMETERS_CHARS:
        name = max(sampling, key=lambda key: len(json.dumps(sampling[key])))
        raise bad_request(f"{name}: too large; the model takes at most {MAX_PARAMETERS_CHARS} characters of "
                          f"sampling parameters as JSON, and these come to {size}", param=name)


def _tensor(name: str, datatype: str, array: np.ndarray) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array)
    return tensor
