# One image for every qrl role: `docker run qrl learner apex --redis URL --run NAME`.
# docker-compose.yml builds it and runs each role in its own container.
FROM python:3.11-slim

# The CPU wheel of torch by default (a fraction of the CUDA one's size). For a GPU learner,
# docker-compose.gpu.yml builds a second image with a CUDA index, e.g.
#   docker build --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 -t qrl:cuda .
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1

# torch first, in its own layer: it changes far less often than qrl does
RUN pip install torch==2.13.0 --index-url "${TORCH_INDEX}"

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
