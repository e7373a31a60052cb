# Triton Inference Server 2.51 (NGC 24.10) serving model_repository with the diffulex engine on a GPU.
#   docker build -t diffulex-triton .
#   docker run --init --gpus all --shm-size=1g -p 8000:8000 -p 8001:8001 -p 8002:8002 diffulex-triton
FROM nvcr.io/nvidia/tritonserver:24.10-py3

# PyTorch built for CUDA 12.6, the CUDA of this image; triton (the GPU kernel compiler) comes with it.
ARG TORCH_VERSION=2.9.1
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
WORKDIR /opt/diffulex-triton

# The Python backend stub runs the image's python3; numpy must stay below 2, or every STRING input
# crashes the stub.
RUN python3 -m pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}" \
    && python3 -m pip install --no-cache-dir numpy==1.26.4 safetensors==0.8.0 transformers==5.17.0 tqdm==4.70.1

COPY pyproject.toml setup.py README.md ./
COPY diffulex_backend/ diffulex_backend/
COPY kernels/ kernels/
COPY client/ client/
RUN python3 -m pip install --no-cache-dir --no-deps .

COPY model_repository/ model_repository/

EXPOSE 8000 8001 8002
# Explicit model control lets the model's watchdog reload it when its stub dies (docs/reliability.md). Run with
# `docker run --init` so that an init process reaps the watchdog once it has done its work.
CMD ["tritonserver", "--model-repository", "/opt/diffulex-triton/model_repository", \
     "--model-control-mode=explicit", "--load-model=diffulex"]
