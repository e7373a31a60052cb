"""The Dockerfile, read offline: NGC's image and entrypoint, the model repository in /models, and a command that runs
tritonserver under explicit model control with the OpenAI front beside it, through the launcher `make serve` uses;
local environments stay out of the build context."""

import json
import re
from pathlib import Path

from diffulex_backend.serving.server_watch import explicit_model_control, server_options

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = (ROOT / "Dockerfile").read_text()


def instruction(name: str) -> list[str]:
    """Every instruction of that name, continuation lines joined."""
    joined = re.sub(r"\\\n\s*", " ", DOCKERFILE)
    return [line[len(name):].strip() for line in joined.splitlines() if line.startswith(name + " ")]


def test_the_image_keeps_ngcs_entrypoint_and_serves_models_with_the_front_beside_tritonserver():
    assert instruction("FROM")[0].startswith("nvcr.io/nvidia/tritonserver:")
    assert instruction("ENTRYPOINT") == []  # NGC's own stays
    (cmd,) = instruction("CMD")
    argv = json.loads(cmd)
    split = argv.index("--")
    launcher, server = argv[:split], argv[split + 1:]
    assert launcher[:2] == ["python3", "/opt/diffulex-triton/tools/serve.py"]
    launcher_options = server_options(launcher[2:])
    assert launcher_options["model-repository"] == "/models" and launcher_options["openai-port"] == "9000"
    assert server[0] == "tritonserver" and explicit_model_control(server)
    options = server_options(server[1:])
    assert options["model-repository"] == "/models" and options["load-model"] == "diffulex"
    assert options.get("grpc-port", "8001") == launcher_options["grpc-port"]
    assert "COPY model_repository/ /models/" in DOCKERFILE and "COPY tools/serve.py tools/serve.py" in DOCKERFILE
    assert set(instruction("EXPOSE")[0].split()) == {"8000", "8001", "8002", "9000"}
    # The front's own packages are pinned as the Makefile pins them.
    for package in re.findall(r"(fastapi==\S+|uvicorn==\S+)", (ROOT / "Makefile").read_text()):
        assert package in DOCKERFILE


def test_local_environments_stay_out_of_the_build_context():
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".venv/", ".venv-genai-perf/", ".runtime/", ".git/"} <= set(ignored)


def test_the_image_installs_the_flash_attn_the_makefile_pins():
    makefile = (ROOT / "Makefile").read_text()
    pinned = re.search(r"^FLASH_ATTN_PACKAGES := (.*?)\n\n", makefile, re.S | re.M).group(1)
    wanted = set(pinned.replace("\\", " ").split())
    assert len(wanted) == 8 and all("==" in package for package in wanted)
    installed = set(re.findall(r"[\w.-]+==[\w.]+", DOCKERFILE))
    assert wanted <= installed
