"""Clients of the session's tritonserver (the `server` fixture of tests/conftest.py), over each protocol."""

import pytest
from served_model import url_for

from diffulex_client import AsyncDiffulexClient, DiffulexClient


@pytest.fixture(params=("grpc", "http"))
def protocol(request) -> str:
    return request.param


@pytest.fixture
def client(server, protocol) -> DiffulexClient:
    return DiffulexClient(url_for(server, protocol), protocol, timeout=120)


@pytest.fixture
def async_client(server, protocol) -> AsyncDiffulexClient:
    return AsyncDiffulexClient(url_for(server, protocol), protocol, timeout=120)
