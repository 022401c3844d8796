# The trainer image: verl (pins transformers <5.11, so it cannot share an environment with vLLM).
#   cpu: docker build -f infra/docker/trainer.Dockerfile -t flywheel-trainer .
#   gpu: docker build -f infra/docker/trainer.Dockerfile \
#            --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 -t flywheel-trainer-gpu .
# The lines up to the torch install match base.Dockerfile, so both images share those layers.
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

ENV PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    DATA_DIR=/data WEIGHTS_DIR=/weights LOG_FORMAT=json
WORKDIR /app

# The same torch version on both paths; the constraints pin (==2.13.0) also matches the +cu128 build.
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
RUN pip install ${TORCH_INDEX:+--index-url ${TORCH_INDEX}} torch==2.13.0

ARG EXTRAS=trainer,hf,data
COPY pyproject.toml ./
COPY infra/constraints-cpu.txt infra/
RUN pip install -c infra/constraints-cpu.txt ".[${EXTRAS}]" && pip uninstall -y flywheel-rl

COPY . .
RUN pip install --no-deps -e . \
    && useradd --create-home --uid 1000 flywheel \
    && mkdir -p /data /weights && chown flywheel /data /weights
USER flywheel
# The delta kernels' machine code in the image (numba's cache, in the service user's home): a container on a CPU
# like the builder's loads it instead of compiling (~6 s of a core when a run opens; another CPU compiles anew).
RUN python -c "from shared.weights.kernels import warm_up; warm_up()"
CMD ["flywheel-trainer"]
