# GPU image: vLLM 0.26 (torch 2.11 + CUDA) with the gateway on top.
FROM vllm/vllm-openai:v0.26.0
RUN apt-get update && apt-get install -y --no-install-recommends libopus0 && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY pyproject.toml README.md ./
COPY engine ./engine
COPY gateway ./gateway
COPY static ./static
COPY assets ./assets
COPY config ./config
COPY deploy/entrypoint.sh ./deploy/entrypoint.sh
# torch and vllm come from the base image; install the rest.
RUN pip install --no-cache-dir -e . && python -c "import torch, vllm; print(torch.__version__, vllm.__version__)"
# The compile caches (the flow's torch.compile, its Triton kernels, vLLM's compiled LM) live
# in the data volume: a restarted container reuses them instead of compiling again.
ENV COSYVOICE_GW_HOST=0.0.0.0 \
    COSYVOICE_GW_PORT=8080 \
    COSYVOICE_GW_DATA_DIR=/data \
    TORCHINDUCTOR_CACHE_DIR=/data/cache/torchinductor \
    TRITON_CACHE_DIR=/data/cache/triton \
    VLLM_CACHE_ROOT=/data/cache/vllm
EXPOSE 8080
# cosyvoice-gateway, under an NVIDIA MPS daemon of its own with COSYVOICE_MPS=1 (README).
ENTRYPOINT ["/app/deploy/entrypoint.sh"]
