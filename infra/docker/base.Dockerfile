# The CPU image every service runs in the `cpu` profile (api, jobs, controller, env-worker, weight-server,
# rollout-worker with the HF engine): core + envs + data + hf, CPU torch.
#   docker build -f infra/docker/base.Dockerfile -t flywheel-cpu .
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    DATA_DIR=/data WEIGHTS_DIR=/weights LOG_FORMAT=json
WORKDIR /app

# torch first, from the CPU index, so the extras below never pull CUDA wheels (pinned by the constraints).
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
RUN pip install --index-url ${TORCH_INDEX} torch==2.13.0

COPY . .
# Editable: shared.db.migrate finds migrations/ next to the source tree.
RUN pip install -c infra/constraints-cpu.txt -e ".[envs,data,hf]" \
    && useradd --create-home --uid 1000 flywheel \
    && mkdir -p /data /weights && chown flywheel /data /weights
USER flywheel
CMD ["flywheel-api"]
