"""The client suite runs against the real tritonserver that the server suite's fixtures start.

Those fixtures live in tests/server/conftest.py; it is loaded here under another module name and its
fixtures are re-exported, so this folder gets the same checkpoint, settings and server.
"""

import importlib.util
import sys
from pathlib import Path

import pytest
from served_model import url_for

from diffulex_client import AsyncDiffulexClient, DiffulexClient

SERVER_TESTS = Path(__file__).resolve().parents[1] / "server"
sys.path.insert(0, str(SERVER_TESTS))  # for the `from triton_server import ...` in the fixtures
_spec = importlib.util.spec_from_file_location("server_fixtures", SERVER_TESTS / "conftest.py")
server_fixtures = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(server_fixtures)

checkpoint = server_fixtures.checkpoint
missing_checkpoint = server_fixtures.missing_checkpoint
engine = server_fixtures.engine
server = server_fixtures.server


@pytest.fixture(params=("grpc", "http"))
def protocol(request) -> str:
    return request.param


@pytest.fixture
def client(server, protocol) -> DiffulexClient:
    return DiffulexClient(url_for(server, protocol), protocol, timeout=120)


@pytest.fixture
def async_client(server, protocol) -> AsyncDiffulexClient:
    return AsyncDiffulexClient(url_for(server, protocol), protocol, timeout=120)
