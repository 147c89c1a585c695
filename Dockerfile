# One image for every pagefleet service (gateway, scheduler, worker, `pagefleet up`).
#   docker build -t pagefleet:cpu .                              # CPU (default)
#   docker build --build-arg VARIANT=cuda -t pagefleet:cuda .    # NVIDIA GPUs, with Triton
# The command picks the service: `pagefleet gateway|scheduler|worker ...`.
ARG VARIANT=cpu

FROM python:3.11-slim-bookworm AS base-cpu
# CPU-only torch wheels: no CUDA libraries in the image.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_EXTRA_INDEX_URL=${TORCH_INDEX_URL} PAGEFLEET_EXTRAS=""

FROM nvidia/cuda:12.8.1-runtime-ubuntu24.04 AS base-cuda
ARG DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
 && apt-get install -y --no-install-recommends software-properties-common gpg-agent \
 && add-apt-repository -y ppa:deadsnakes/ppa \
 && apt-get install -y --no-install-recommends python3.11 python3.11-venv python3.11-dev build-essential \
 && rm -rf /var/lib/apt/lists/* \
 && python3.11 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH PAGEFLEET_EXTRAS="[triton]"

FROM base-${VARIANT}
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app
# Dependencies first (cached until pyproject.toml changes), then the code.
COPY pyproject.toml ./
RUN python -c "import tomllib; d = tomllib.load(open('pyproject.toml', 'rb'))['project']; \
print('\n'.join(d['dependencies'] + (d['optional-dependencies'].get('triton', []) if '$PAGEFLEET_EXTRAS' else [])))" \
    > /tmp/requirements.txt \
 && pip install -r /tmp/requirements.txt
COPY . .
RUN pip install --no-deps . \
 && useradd --create-home --uid 10001 pagefleet
USER pagefleet
# gateway 50051, scheduler 50052, worker 50061, /metrics 9400 (each set by flags).
EXPOSE 50051 50052 50061 9400
ENTRYPOINT []
CMD ["pagefleet", "up"]
