# One image for every qrl role: `docker run qrl learner apex --redis URL --run NAME`.
# docker-compose.yml builds it and runs each role in its own container.
#
# Build arguments (docker-compose.yml passes them from .env):
#   QRL_BASE_IMAGE  the base: a Debian-like image with python3 (>= 3.10) and its venv module
#   TORCH_INDEX     the index torch comes from: the CPU wheel by default (a fraction of the
#                   CUDA one's size); docker-compose.gpu.yml builds qrl:cuda with a CUDA index
#   TORCH_WHEEL     or a torch wheel file in docker/wheels/ (a path in the build context,
#                   e.g. docker/wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl)
ARG QRL_BASE_IMAGE=python:3.11-slim

# torch in a build stage of its own: the wheel file never lands in the image, and this stage
# is cached until the base, the index or the wheel change (far less often than qrl does)
FROM ${QRL_BASE_IMAGE} AS torch
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG TORCH_WHEEL=
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
COPY docker/wheels/ /wheels/
RUN python3 -m venv /opt/qrl \
    && if [ -n "${TORCH_WHEEL}" ]; then /opt/qrl/bin/pip install "/wheels/${TORCH_WHEEL#docker/wheels/}"; \
       else /opt/qrl/bin/pip install torch==2.13.0 --index-url "${TORCH_INDEX}"; fi

FROM ${QRL_BASE_IMAGE}
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/qrl PATH=/opt/qrl/bin:$PATH
COPY --from=torch /opt/qrl /opt/qrl

# qrl (TensorBoard comes with it: the learners write event files next to metrics.csv)
WORKDIR /src
COPY pyproject.toml README.md ./
COPY qrl ./qrl
RUN pip install . && rm -rf /src

# not root; /runs (checkpoints) is a volume in docker-compose.yml and takes this owner
RUN useradd --create-home --uid 1000 qrl && mkdir /runs && chown qrl:qrl /runs
USER qrl
WORKDIR /runs

ENTRYPOINT ["qrl"]
CMD ["--help"]
