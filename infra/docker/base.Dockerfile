# The CPU image every service runs by default (api, jobs, controller, env-worker, weight-server, and the
# rollout worker with the HF engine): core + envs + data + hf, CPU torch.
#   docker build -f infra/docker/base.Dockerfile -t flywheel-cpu .
# BASE_IMAGE: any image with Python 3.11 whose `python`/`pip` are first on PATH (make compose-smoke builds a
# local Debian one when no registry is reachable). TORCH_INDEX empty: torch from pip's configured indexes.
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

ENV PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    DATA_DIR=/data WEIGHTS_DIR=/weights LOG_FORMAT=json
WORKDIR /app

# torch first, from the CPU index, so the extras below never pull CUDA wheels (pinned by the constraints).
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
RUN pip install ${TORCH_INDEX:+--index-url ${TORCH_INDEX}} torch==2.13.0

# bubblewrap + libseccomp: the env worker's default sandbox for model-written code (mode `namespaces`);
# after torch: the layers up to torch are trainer.Dockerfile's too, built once for both images.
RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends bubblewrap \
    libseccomp2 && rm -rf /var/lib/apt/lists/*

# Third-party dependencies before the source, so a source change rebuilds only the last layers.
ARG EXTRAS=envs,data,hf,agents
COPY pyproject.toml ./
COPY infra/constraints-cpu.txt infra/
RUN pip install -c infra/constraints-cpu.txt ".[${EXTRAS}]" && pip uninstall -y flywheel-rl

COPY . .
# Editable: shared.platform.db.migrate finds migrations/ next to the source tree.
RUN pip install --no-deps -e . \
    && useradd --create-home --uid 1000 flywheel \
    && mkdir -p /data /weights && chown flywheel /data /weights
USER flywheel
# The delta kernels' machine code in the image (numba's cache, in the service user's home): a container on a CPU
# like the builder's loads it instead of compiling (~6 s of a core when a run opens; another CPU compiles anew).
RUN python -c "from shared.weights.kernels import warm_up; warm_up()"
CMD ["flywheel-api"]
