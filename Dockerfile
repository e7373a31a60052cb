# Triton Inference Server 2.62 (NGC 25.10) serving the model repository in /models with the diffulex engine on a GPU,
# and the OpenAI-compatible front beside it on port 9000.
#   docker build -t diffulex-triton .
#   docker run --init --gpus all --shm-size=1g -p 8000:8000 -p 8001:8001 -p 8002:8002 -p 9000:9000 diffulex-triton
# Mount another repository over /models (`-v $PWD/my_repository:/models:ro`) to serve another checkpoint.
#
# 25.10 is the first release whose HTTP front end refuses a request body past --http-max-input-size (server 2.59) and
# no longer crashes on a large JSON body (2.62); 2.51, which `make serve` runs from the nvidia-pytriton wheel, crashes
# at about 4.19 MB. Its CUDA is 13.0 and its Python 3.12 (Ubuntu 24.04).
FROM nvcr.io/nvidia/tritonserver:25.10-py3

# The PyTorch the GPU benchmarks and `make gpu-check` ran: 2.11 built for CUDA 13.0, with triton 3.6 (the GPU kernel
# compiler) as its dependency.
ARG TORCH_VERSION=2.11.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu130
# The image's Python is the system's (PEP 668): this image is its only user.
ENV PIP_BREAK_SYSTEM_PACKAGES=1

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
WORKDIR /opt/diffulex-triton

# The Python backend stub runs the image's python3; numpy must stay below 2, or every STRING input
# crashes the stub.
RUN python3 -m pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}" \
    && python3 -m pip install --no-cache-dir numpy==1.26.4 safetensors==0.8.0 transformers==5.17.0 tqdm==4.70.1 \
       "tritonclient[grpc]==2.51.0" fastapi==0.163.2 uvicorn==0.54.0

# flash-attn's Hopper kernels, which `attention_backend` auto takes for prompts on compute capability 9.0 and newer
# (README, "Attention backends"): the Makefile's FLASH_ATTN_PACKAGES, with what the image lacks of their dependencies.
RUN python3 -m pip install --no-cache-dir flash-attn-4==4.0.0b36 nvidia-cutlass-dsl==4.8.1 \
       nvidia-cutlass-dsl-libs-base==4.8.1 nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1 \
       apache-tvm-ffi==0.1.15.post2 torch-c-dlpack-ext==0.1.5 quack-kernels==0.6.5

COPY pyproject.toml setup.py README.md ./
COPY diffulex_backend/ diffulex_backend/
COPY kernels/ kernels/
COPY client/ client/
RUN python3 -m pip install --no-cache-dir --no-deps .

COPY tools/serve.py tools/serve.py
COPY model_repository/ /models/

EXPOSE 8000 8001 8002 9000
# NGC's entrypoint stays; the command is the launcher `make serve` uses: tritonserver, and the OpenAI front beside
# it, stopped with it. Explicit model control lets the model's watchdog reload it when its stub dies
# (docs/reliability.md). Run with `docker run --init` so that an init process reaps the watchdog once it has done
# its work. The launcher kills a server still running 5 s past its exit timeout, which an open gRPC stream can hold
# (docs/reliability.md); `docker stop` kills the container 10 s after its signal unless given `-t 35` or more.
# In a pod, run the front as a sidecar instead (deploy/).
CMD ["python3", "/opt/diffulex-triton/tools/serve.py", "--model-repository", "/models", "--openai-port", "9000", \
     "--grpc-port", "8001", "--", \
     "tritonserver", "--model-repository", "/models", "--model-control-mode=explicit", "--load-model=diffulex", \
     "--grpc-port", "8001", "--http-max-input-size", "4194304", "--exit-timeout-secs", "30"]
