"""Page retention through tritonserver: a request's retention_ratio and head_select in its parameters give the
engine's tokens for the same settings (whose page accounting tests/unit checks), every page returns to the pool
when it ends, and a bad value is refused by name."""

import json

import pytest
from served import generate, ids, metrics, post, reference, wait_for

PROMPT = "a long prompt, most of whose pages a sparse request drops: " * 2  # 118 tokens: 30 pages of 4
PARAMS = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}


@pytest.mark.parametrize("sparse", [{"retention_ratio": 0.5}, {"retention_ratio": 0.3, "head_select": False}])
def test_a_sparse_request_is_served_the_engine_tokens(server, engine, sparse):
    params = PARAMS | sparse
    (expected,) = reference(engine, [PROMPT], **params)
    assert ids(generate(server, {"text_input": PROMPT, "parameters": params, "exclude_input_in_output": True}
                        )["output_ids"]) == expected.token_ids
    wait_for(lambda: metrics(server)["diffulex_kv_pages_used"] == 0)


def test_the_sparse_and_the_dense_request_differ_on_the_random_model(server, engine):
    dense, sparse = (ids(generate(server, {"text_input": PROMPT, "parameters": PARAMS | extra,
                                           "exclude_input_in_output": True})["output_ids"])
                     for extra in ({}, {"retention_ratio": 0.3}))
    assert dense != sparse  # otherwise the test above could not tell a dropped page from a kept one


@pytest.mark.parametrize("value, shown", [(0, "0"), (1.5, "1.5"), ("half", "'half'")])
def test_a_bad_ratio_is_refused_by_name(server, value, shown):
    status, payload = post(f"{server.http_url}/v2/models/diffulex/generate",
                           {"text_input": PROMPT, "parameters": PARAMS | {"retention_ratio": value}})
    assert (status, json.loads(payload)["error"]) == (
        400,
        f"request parameters: sampling parameter 'retention_ratio' must be a number in (0, 1] or null, got {shown}")
