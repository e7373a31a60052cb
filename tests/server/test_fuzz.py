"""Fuzzing the request contract with hypothesis: classes of input, not examples. Every number at its type's limits,
NaN and infinities, wrong types, nesting and sizes, for every sampling parameter. Parsing either accepts a value
or refuses it with BadRequest naming the field, never anything else; through the real server every request ends
with a result or a 400 that says why, and the server keeps serving."""

import json
import math

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from served import generate, ids, post, reference

from diffulex_backend import SamplingParams
from diffulex_backend.serving.request_parsing import BadRequest, parse_request
from diffulex_backend.serving.text_values import field_types

INT_EDGES = [0, 1, -1, 2**31 - 1, 2**31, 2**32, 2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63), 10**30]
FLOAT_EDGES = [0.0, -0.0, 1e-45, 1e-30, 1e-5, 0.5, 1.0, 1.5, 3.4028234663852886e38, 3.5e38, 1e308, -1.0,
               math.inf, -math.inf, math.nan]

scalars = st.one_of(
    st.sampled_from(INT_EDGES), st.integers(), st.sampled_from(FLOAT_EDGES), st.floats(allow_nan=True),
    st.booleans(), st.none(), st.text(max_size=20), st.sampled_from(["16", "0.5", "true", "inf", "nan", "1e400", ""]),
)
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner,
                                                                                            max_size=3), max_leaves=12)
keys = st.sampled_from(SamplingParams.field_names() + ["max_token", "beam", ""])
parameter_objects = st.dictionaries(keys, values, max_size=5)


def as_json(params: dict) -> str:
    return json.dumps(params, allow_nan=True)  # NaN and Infinity on purpose: clients send them


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(parameter_objects)
def test_parsing_accepts_a_valid_object_or_refuses_it_by_name(params):
    inputs = {"text_input": np.array([[b"hi"]], dtype=np.object_),
              "sampling_parameters": np.array([[as_json(params).encode()]], dtype=np.object_)}
    try:
        parsed = parse_request(inputs)
    except BadRequest as err:
        message = str(err)
        assert message.startswith("input 'sampling_parameters'")
        assert ("sampling parameter '" in message or "unknown sampling parameter" in message
                or "is not a number a sampling parameter can take" in message or "nested more than" in message)
        return
    # Accepted: every value sent arrives as sent (a string converted as documented), every other field keeps its
    # default; nothing is clamped, rounded or dropped on the way.
    chosen, defaults = parsed.params, SamplingParams()
    for name in SamplingParams.field_names():
        expected = sent_value(name, params[name]) if name in params else getattr(defaults, name)
        assert getattr(chosen, name) == expected, name


def sent_value(name: str, value):
    """What a sent value must arrive as: strings become the field's number or boolean, one stop string a list."""
    if name == "stop" and isinstance(value, str):
        return [value]
    if not isinstance(value, str) or name in ("confidence", "stop", "lora_name"):
        return value
    text = value.strip()
    # The field's declared type, not its default's: head_select defaults to None.
    words = ("true", "1", "yes", "on", "false", "0", "no", "off")
    if text.lower() in words and field_types(SamplingParams)[name] is bool:
        return text.lower() in ("true", "1", "yes", "on")
    try:
        return int(text)
    except ValueError:
        return float(text)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(parameter_objects)
def test_the_server_answers_every_fuzzed_request_and_keeps_serving(server, engine, params):
    params = {"max_tokens": 4, **params}  # short outputs unless the fuzzed object says otherwise
    status, payload = post(f"{server.http_url}/v2/models/diffulex/generate",
                           {"text_input": "hi", "sampling_parameters": as_json(params)})
    body = json.loads(payload)
    if status == 200:
        assert isinstance(body["text_output"], str)
    else:
        assert status == 400 and body["error"], (status, body)


def test_the_server_serves_exactly_after_the_fuzzing(server, engine):
    (expected,) = reference(engine, ["hello"], max_tokens=8, temperature=0)
    output = generate(server, {"text_input": "hello", "parameters": {"max_tokens": 8, "temperature": 0},
                               "exclude_input_in_output": True})
    assert ids(output["output_ids"]) == expected.token_ids
