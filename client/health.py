"""Is the server up, is the model loaded, and with which engine settings.

The engine settings are the `parameters` of the model's config.pbtxt as the server loaded them, read
from the model configuration endpoint; every value is a string, as Triton holds it. The resolved settings are
what each model instance's engine made of them (the device `auto` chose, the dtype, the KV pages it sized), read
from the `diffulex_engine_setting_info` series on Triton's metrics endpoint, by instance.
"""

from __future__ import annotations

import http.client
import json
import re
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field, replace
from urllib.parse import quote

import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from .errors import from_os_error, from_triton_exception
from .protocol import Protocol


@dataclass(frozen=True)
class ServerHealth:
    server_live: bool
    server_ready: bool
    model_ready: bool
    engine_settings: dict[str, str] = field(default_factory=dict)  # empty while the model is not ready
    # "instance (device)" -> setting -> value; empty while the model is not ready or the metrics are not reachable
    resolved_settings: dict[str, dict[str, str]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.server_live and self.server_ready and self.model_ready

    def to_dict(self) -> dict:
        return asdict(self) | {"ok": self.ok}


SETTING_SERIES = re.compile(r'^diffulex_engine_setting_info\{(.*)\} ', re.MULTILINE)
LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
UNESCAPE = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


def check_health(url: str, protocol: Protocol, model: str, timeout: float | None,
                 metrics_url: str | None = None) -> ServerHealth:
    """`metrics_url`: Triton's metrics endpoint (default: port 8002 of the server's host)."""
    try:
        health = _grpc_health(url, model, timeout) if protocol is Protocol.GRPC else _http_health(url, model, timeout)
    except InferenceServerException as err:
        raise from_triton_exception(err) from None
    except OSError as err:
        raise from_os_error(err, url) from None
    if not health.model_ready:
        return health
    host = url.removeprefix("http://").rpartition(":")[0] or "localhost"
    return replace(health, resolved_settings=resolved_settings(metrics_url or f"http://{host}:8002/metrics", model,
                                                               timeout))


def resolved_settings(metrics_url: str, model: str, timeout: float | None) -> dict[str, dict[str, str]]:
    """The model's resolved settings by instance, from Triton's metrics; empty when they cannot be read (the
    metrics port closed or elsewhere), since readiness does not depend on them."""
    try:
        with urllib.request.urlopen(metrics_url, timeout=10.0 if timeout is None else timeout) as response:
            text = response.read().decode("utf-8", "replace")
    except (OSError, urllib.error.URLError, ValueError):
        return {}
    instances: dict[str, dict[str, str]] = {}
    for match in SETTING_SERIES.finditer(text):
        labels = {name: re.sub(r'\\[\\"n]', lambda m: UNESCAPE[m.group()], value)
                  for name, value in LABEL.findall(match.group(1))}
        if labels.get("model") == model:
            instance = f"{labels.get('model_instance', '?')} ({labels.get('device', '?')})"
            instances.setdefault(instance, {})[labels.get("setting", "")] = labels.get("value", "")
    return instances


def _grpc_health(url: str, model: str, timeout: float | None) -> ServerHealth:
    with grpcclient.InferenceServerClient(url) as client:
        live = client.is_server_live(client_timeout=timeout)
        ready = client.is_server_ready(client_timeout=timeout)
        model_ready = client.is_model_ready(model, client_timeout=timeout)
        config = client.get_model_config(model, as_json=True, client_timeout=timeout)["config"] if model_ready else {}
        return ServerHealth(live, ready, model_ready, _settings(config))


def _http_health(url: str, model: str, timeout: float | None) -> ServerHealth:
    """Over the standard library's HTTP client: the four GETs need nothing more."""
    host, _, port = url.removeprefix("http://").partition(":")
    connection = http.client.HTTPConnection(host, int(port or 80), timeout=60.0 if timeout is None else timeout)

    def get(path: str) -> tuple[int, bytes]:
        connection.request("GET", path)
        response = connection.getresponse()
        return response.status, response.read()

    try:
        name = quote(model, safe="")
        live, ready = get("/v2/health/live")[0] == 200, get("/v2/health/ready")[0] == 200
        model_ready = get(f"/v2/models/{name}/ready")[0] == 200
        config = json.loads(get(f"/v2/models/{name}/config")[1]) if model_ready else {}
        return ServerHealth(live, ready, model_ready, _settings(config))
    finally:
        connection.close()


def _settings(config: dict) -> dict[str, str]:
    return {name: holder.get("string_value", "") for name, holder in config.get("parameters", {}).items()}
