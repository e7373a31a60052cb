"""The manifests in deploy/: valid for the Kubernetes API (its strict schemas, bundled with kubernetes-validate, so
nothing is fetched) and for KServe's InferenceService, and serving the way docs/scaling.md says: tritonserver
loads the model under explicit model control (so the model's watchdog can reload it), on tritonserver's ports,
with probes on Triton's health endpoints, a startup probe long enough for the engine's warm-up, and a grace period
that outlasts the exit timeout."""

import copy
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from diffulex_backend.serving.server_watch import explicit_model_control, http_endpoint, server_options
from diffulex_client.openai_front.cli import build_parser
from triton_server import serve_launcher

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
# The oldest and the newest Kubernetes release whose schemas kubernetes-validate bundles.
KUBERNETES_VERSIONS = ["1.25.0", kubernetes_validate.latest_version()]
TRITON_PORTS = {"http": 8000, "grpc": 8001, "metrics": 8002}  # tritonserver's defaults, which clients expect
# Loading a large checkpoint, then compiling the kernels and capturing the CUDA graphs on a cold kernel cache.
MIN_STARTUP_WINDOW_S = 600
# After an engine failure the model is unloaded; traffic should leave the replica within seconds.
MAX_READINESS_WINDOW_S = 15

# What KServe requires of an InferenceService whose predictor is a container of its own. The predictor is a pod
# spec (checked against Kubernetes' own schema below) plus these fields of KServe's.
KSERVE_PREDICTOR_FIELDS = {
    "minReplicas": {"type": "integer", "minimum": 0},
    "maxReplicas": {"type": "integer", "minimum": 1},
    "scaleTarget": {"type": "integer", "minimum": 1},
    "scaleMetric": {"enum": ["cpu", "memory", "concurrency", "rps"]},
    "containerConcurrency": {"type": "integer", "minimum": 0},
    "timeout": {"type": "integer", "minimum": 1},
    "labels": {"type": "object", "additionalProperties": {"type": "string"}},
    "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
}
INFERENCE_SERVICE_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "serving.kserve.io/v1beta1"},
        "kind": {"const": "InferenceService"},
        "metadata": {
            "type": "object",
            "required": ["name"],
            # The name becomes the host name of the service: a DNS label.
            "properties": {"name": {"type": "string", "pattern": "^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$"},
                           "annotations": {"type": "object", "additionalProperties": {"type": "string"}}},
        },
        "spec": {
            "type": "object",
            "required": ["predictor"],
            "additionalProperties": False,
            "properties": {"predictor": {
                "type": "object",
                "required": ["containers"],
                "properties": {**KSERVE_PREDICTOR_FIELDS, "containers": {
                    "type": "array", "minItems": 1,
                    "prefixItems": [{"type": "object", "required": ["name", "image"],
                                     "properties": {"name": {"const": "kserve-container"}}}]}},
            }},
        },
    },
}


def documents(path: Path) -> list[dict]:
    return [document for document in yaml.safe_load_all(path.read_text()) if document]


def kubernetes_resources() -> dict[str, dict]:
    resources = {}
    for path in sorted((DEPLOY / "kubernetes").glob("*.yaml")):
        for document in documents(path):
            resources[document["kind"]] = document
    return resources


def inference_service() -> dict:
    (document,) = documents(DEPLOY / "kserve" / "inferenceservice.yaml")
    return document


def predictor_as_pod(service: dict) -> dict:
    """The predictor's pod-spec part as a Pod, for Kubernetes' schema: everything but KServe's own fields."""
    predictor = service["spec"]["predictor"]
    spec = {key: value for key, value in predictor.items() if key not in KSERVE_PREDICTOR_FIELDS}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": service["metadata"]["name"]}, "spec": spec}


TRITON_CONTAINERS = ("tritonserver", "kserve-container")
FRONT_CONTAINER = "openai-front"
OPENAI_PORT = 9000  # the front's port, as `make serve` and Triton's own OpenAI frontend use


def container_named(pod: dict, names) -> dict:
    (container,) = [item for item in pod["containers"] if item["name"] in names]
    return container


def triton_container(pod: dict) -> dict:
    return container_named(pod, TRITON_CONTAINERS)


def served_pods() -> dict[str, dict]:
    """The pod spec that runs tritonserver, from each way of deploying."""
    return {"kubernetes": kubernetes_resources()["Deployment"]["spec"]["template"]["spec"],
            "kserve": predictor_as_pod(inference_service())["spec"]}


# ---- valid for Kubernetes and KServe ----------------------------------------------------------------------------
@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_the_kubernetes_manifests_pass_kubernetes_strict_schemas(version):
    resources = kubernetes_resources()
    assert sorted(resources) == ["Deployment", "Service"]
    for resource in resources.values():
        kubernetes_validate.validate(resource, version, strict=True)


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_the_inference_service_has_kserves_fields_and_a_valid_pod(version):
    service = inference_service()
    jsonschema.validate(service, INFERENCE_SERVICE_SCHEMA)
    predictor = service["spec"]["predictor"]
    assert predictor["minReplicas"] <= predictor["maxReplicas"]
    kubernetes_validate.validate(predictor_as_pod(service), version, strict=True)


def test_the_checks_refuse_a_misspelt_field():
    """The schemas are strict: a probe under a misspelt name, which Kubernetes would drop, fails the check."""
    deployment = copy.deepcopy(kubernetes_resources()["Deployment"])
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    container["readinesProbe"] = container.pop("readinessProbe")
    with pytest.raises(kubernetes_validate.ValidationError, match="readinesProbe"):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSIONS[-1], strict=True)
    service = copy.deepcopy(inference_service())
    service["spec"]["predictor"]["maxReplica"] = service["spec"]["predictor"].pop("maxReplicas")
    with pytest.raises(kubernetes_validate.ValidationError, match="maxReplica"):
        kubernetes_validate.validate(predictor_as_pod(service), KUBERNETES_VERSIONS[-1], strict=True)
    service["spec"]["predicter"] = service["spec"].pop("predictor")
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(service, INFERENCE_SERVICE_SCHEMA)


# ---- what users depend on -------------------------------------------------------------------------------------
def container_port(container: dict, port) -> int:
    """A probe's or a Service's port, by number or by the container port's name."""
    if isinstance(port, int):
        return port
    (number,) = [item["containerPort"] for item in container["ports"] if item["name"] == port]
    return number


@pytest.mark.parametrize("way", ["kubernetes", "kserve"])
def test_tritonserver_loads_the_model_under_explicit_control_on_its_own_ports(way):
    pod = served_pods()[way]
    container = triton_container(pod)
    argv = container["command"] + container["args"]
    options = server_options(argv[1:])
    assert argv[0] == "tritonserver"
    assert options["load-model"] == "diffulex"
    # The model's watchdog reloads it through the repository API, on the HTTP endpoint it reads from this line.
    assert explicit_model_control(argv)
    assert http_endpoint(argv) == ("127.0.0.1", TRITON_PORTS["http"])
    assert {item["name"]: item["containerPort"] for item in container["ports"]} == TRITON_PORTS
    assert {name: int(options[f"{name}-port"]) for name in TRITON_PORTS} == TRITON_PORTS
    # The model repository is the read-only volume mounted where --model-repository points.
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    (mount,) = [mount for mount in container["volumeMounts"] if mount["mountPath"] == options["model-repository"]]
    assert mount.get("readOnly") and "persistentVolumeClaim" in volumes[mount["name"]]


@pytest.mark.parametrize("way", ["kubernetes", "kserve"])
def test_probes_ask_tritons_health_endpoints_and_the_startup_probe_outlasts_the_warm_up(way):
    container = triton_container(served_pods()[way])
    probes = {kind: container[f"{kind}Probe"] for kind in ("startup", "readiness", "liveness")}
    paths = {kind: probe["httpGet"]["path"] for kind, probe in probes.items()}
    assert paths == {"startup": "/v2/health/ready", "readiness": "/v2/health/ready", "liveness": "/v2/health/live"}
    assert {container_port(container, probe["httpGet"]["port"]) for probe in probes.values()} == {TRITON_PORTS["http"]}

    def window(probe):  # how long a probe keeps failing before it acts
        return probe.get("periodSeconds", 10) * probe.get("failureThreshold", 3)

    assert window(probes["startup"]) >= MIN_STARTUP_WINDOW_S
    assert window(probes["readiness"]) <= MAX_READINESS_WINDOW_S
    # Liveness restarts the container: it must not fire while a reload or a long step keeps the server busy.
    assert window(probes["liveness"]) > window(probes["readiness"])


@pytest.mark.parametrize("way", ["kubernetes", "kserve"])
def test_the_grace_period_leaves_the_exit_timeout_and_then_ends_a_server_that_open_grpc_streams_hold(way):
    pod = served_pods()[way]
    launcher = serve_launcher()
    exit_timeout = float(server_options(triton_container(pod)["args"]).get("exit-timeout-secs",
                                                                            launcher.TRITON_EXIT_TIMEOUT_S))
    # tritonserver stops within its exit timeout; past it, a gRPC stream held open keeps Triton 2.51 running for ever,
    # and the kubelet's SIGKILL at the end of the grace period ends it, leaving the margin that tools/serve.py leaves.
    assert pod["terminationGracePeriodSeconds"] >= exit_timeout + launcher.EXIT_MARGIN_S


@pytest.mark.parametrize("way", ["kubernetes", "kserve"])
def test_the_pod_has_a_gpu_a_large_shm_and_reaps_the_watchdog(way):
    pod = served_pods()[way]
    container = triton_container(pod)
    assert int(container["resources"]["limits"]["nvidia.com/gpu"]) >= 1
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    (shm,) = [mount for mount in container["volumeMounts"] if mount["mountPath"] == "/dev/shm"]
    assert volumes[shm["name"]]["emptyDir"]["medium"] == "Memory"
    assert pod["shareProcessNamespace"] is True


def test_the_service_reaches_every_triton_port_of_the_deployments_pods():
    resources = kubernetes_resources()
    deployment, service = resources["Deployment"], resources["Service"]
    template = deployment["spec"]["template"]
    assert service["spec"]["selector"].items() <= template["metadata"]["labels"].items()
    assert deployment["spec"]["selector"]["matchLabels"].items() <= template["metadata"]["labels"].items()
    triton, front = triton_container(template["spec"]), container_named(template["spec"], [FRONT_CONTAINER])
    reached = sorted((port["port"], container_port(triton if port["targetPort"] in TRITON_PORTS else front,
                                                   port["targetPort"])) for port in service["spec"]["ports"])
    assert reached == sorted((number, number) for number in [*TRITON_PORTS.values(), OPENAI_PORT])
    # A replica is taken out only once its successor is ready: a rollout keeps the serving capacity.
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0


@pytest.mark.parametrize("way", ["kubernetes", "kserve"])
def test_the_openai_front_runs_as_a_sidecar_on_the_pods_triton(way):
    pod = served_pods()[way]
    triton, front = triton_container(pod), container_named(pod, [FRONT_CONTAINER])
    assert front["command"] == ["python3", "-m", "diffulex_client.openai_front"]
    args = build_parser().parse_args(front["args"])  # the front's own parser takes the manifest's line
    triton_options = server_options(triton["args"])
    # It reaches tritonserver's gRPC port over the pod's loopback, and serves the model tritonserver loads.
    assert args.triton_url == f"127.0.0.1:{triton_options['grpc-port']}"
    assert args.model == triton_options["load-model"]
    assert (args.host, args.port) == ("0.0.0.0", OPENAI_PORT)
    assert [item["containerPort"] for item in front["ports"]] == [OPENAI_PORT]
    # The chat template comes from the checkpoint on the model repository's volume, mounted read-only.
    (mount,) = [m for m in front["volumeMounts"] if str(args.tokenizer).startswith(m["mountPath"] + "/")]
    assert mount["readOnly"] and mount["name"] in {m["name"] for m in triton["volumeMounts"]}
    assert str(args.tokenizer) == f"{triton_options['model-repository']}/diffulex/demo-llada"
    # Readiness is the model's, through the front; liveness only that the front answers, so a model reload
    # never restarts it.
    readiness, liveness = front["readinessProbe"], front["livenessProbe"]
    assert readiness["httpGet"]["path"] == "/health"
    assert container_port(front, readiness["httpGet"]["port"]) == OPENAI_PORT
    assert container_port(front, liveness["tcpSocket"]["port"]) == OPENAI_PORT
