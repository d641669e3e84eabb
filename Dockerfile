# syntax=docker/dockerfile:1
#
# vge-serve: Variance-Gated Ensemble model server (`vge serve`).
#
# Base image choice: python:3.11-slim + the PyPI torch/torchvision wheels, NOT an nvidia/cuda base.
#   * The Linux x86_64 torch wheels on PyPI depend on the nvidia-*-cu12/cu13 wheels (cuBLAS, cuDNN,
#     NCCL, the CUDA runtime, ...), so the CUDA user-space libraries come in through pip and are
#     version-matched to torch by construction. An nvidia/cuda *runtime* base would ship a second,
#     possibly mismatched copy of the same libraries (~3 GB extra) that torch never loads.
#   * The only thing needed from the host is the NVIDIA *driver*, which the NVIDIA Container
#     Toolkit mounts into the container when a GPU is requested
#     (`deploy.resources.reservations.devices` in docker-compose.yml, or `docker run --gpus all`).
#   * The same image runs on a CPU-only host: torch simply reports no CUDA device and the service
#     uses VGE_DEVICE=cpu (see docker-compose.cpu.yml).
#
# Layer order: torch/torchvision (huge, pinned) -> the other runtime dependencies (read from
# pyproject.toml) -> the project's own code. Editing models/ or service/ only rebuilds the last
# layers; editing dependencies does not reinstall torch.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm
FROM ${PYTHON_IMAGE}

ARG TORCH_VERSION=2.14.1
ARG TORCHVISION_VERSION=0.29.1

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

# Unprivileged runtime user with a fixed uid/gid (so bind-mounted volumes can be chowned to it).
RUN groupadd --system --gid 10001 vge \
 && useradd --system --uid 10001 --gid vge --home-dir /home/vge --create-home --shell /usr/sbin/nologin vge \
 && python -m venv "$VIRTUAL_ENV"

# 1) torch + torchvision: the largest layer, changes only when the pins change.
RUN pip install "torch==${TORCH_VERSION}" "torchvision==${TORCHVISION_VERSION}"

WORKDIR /app

# 2) The remaining runtime dependencies, taken from pyproject.toml's [project.dependencies] and
#    the extras in VGE_EXTRAS (comma-separated): by default `postgres` (psycopg, for
#    VGE_DB_URL=postgresql://...; the compose postgres profile); add `grpc` for the V2 gRPC
#    front end (VGE_GRPC_PORT): `docker build --build-arg VGE_EXTRAS=postgres,grpc .`
#    (the torch pins above already satisfy the torch/torchvision ranges there).
ARG VGE_EXTRAS=postgres
COPY pyproject.toml ./
RUN python -c "import os, tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; extras = [e.strip() for e in os.environ['VGE_EXTRAS'].split(',') if e.strip()]; print('\n'.join(p['dependencies'] + [d for e in extras for d in p['optional-dependencies'][e]]))" > /tmp/requirements.txt \
 && pip install -r /tmp/requirements.txt \
 && rm /tmp/requirements.txt

# 3) The project itself. The shipped default model (models/zoo/...) and the bundled MNIST split are
#    package data, so they are installed with the package and the image serves out of the box.
COPY README.md ./
COPY models ./models
COPY service ./service
# The check runs `python -I` so it imports the *installed* package (package data included), not /app.
RUN pip install --no-deps . \
 && rm -rf /app/build /app/*.egg-info \
 && python -I -c "from models.zoo import default_model_dir; p = default_model_dir(); assert (p / 'model_card.json').is_file(), p; print('default model:', p)"

# Writable state (job database, trained models) lives on a volume, owned by the runtime user.
# /models and /reviews are the fleet's shared volumes (docker-compose.yml's vge-fleet, the
# Kubernetes PVCs): made here, owned by that user, so that a new named volume mounted there
# starts owned by it too (Docker copies the mount point's owner into an empty volume; a path
# the image lacks would be created root-owned, and neither models nor review images written).
RUN mkdir -p /data/models /data/jobs /data/datasets /models /reviews \
 && chown -R vge:vge /data /models /reviews
VOLUME ["/data"]

# Settings come from the environment (pydantic-settings, prefix VGE_). VGE_MODEL_DIR is left unset
# so the shipped default model is served; set it to a model directory on /data to serve another
# model (an empty string counts as unset).
# VGE_DEVICE=auto picks CUDA when a GPU was passed through, CPU otherwise.
# VGE_API_KEY has no default on purpose: pass it at run time (docker-compose.yml reads it from .env).
ENV VGE_HOST=0.0.0.0 \
    VGE_PORT=8000 \
    VGE_DEVICE=auto \
    VGE_JOBS_DB_URL=sqlite:////data/jobs.sqlite3 \
    VGE_JOBS_DIR=/data/jobs \
    VGE_MODELS_ROOT=/data/models \
    VGE_DATA_ROOT=/data/datasets

# Numeric uid:gid (hadolint DL3066): resolvable even where the host has no 'vge' user.
USER 10001:10001
WORKDIR /home/vge
EXPOSE 8000

# No curl/wget in the slim image: probe /healthz with the Python standard library.
# Exec form (hadolint DL3025); an HTTP error or refused connection raises -> exit status 1 -> unhealthy.
HEALTHCHECK --interval=15s --timeout=5s --start-period=60s --retries=3 \
  CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('VGE_PORT', '8000'), timeout=4)"]

ENTRYPOINT ["vge", "serve"]
