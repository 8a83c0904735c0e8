# The image the Kubernetes manifests run (deploy/kubernetes/): accel-trainer installed as a wheel, with its recipes
# and layouts (package data: `accel-trainer list` and layout=NAME work from any folder), torch's CPU build.
#   docker build -t accel-trainer:0.1.0 .
#   docker build -t accel-trainer:0.1.0-cu128 --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
#   docker run --rm accel-trainer:0.1.0 accel-trainer train gpt max_steps=20
# The tag is the package's version (pyproject.toml), which the manifests' `image:` names; push the image where the
# cluster pulls from and name that in `image:`. EXTRAS picks the package's extras (pyproject.toml), "" for none.
# CI checks this file without building it (no Docker daemon there): hadolint, and tests/test_dockerfile.py (the
# torch pin is the Makefile's, every COPY source exists and passes .dockerignore, the user is not root).
FROM python:3.11-slim

# uid 1000, numeric so that Kubernetes' runAsNonRoot can check it; the manifests' fsGroup 1000 lets it write the
# run folder's volume.
RUN groupadd --gid 1000 trainer \
    && useradd --create-home --uid 1000 --gid 1000 trainer

# tcmalloc, which the accel-trainer command trains on where installed: CPU steps faster in less memory than glibc's
# malloc (docs/memory.md). (DL3008 asks for a pinned Debian version, which a point release of the base image drops.)
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends libtcmalloc-minimal4 \
    && rm -rf /var/lib/apt/lists/*

# The Makefile's torch pin, a CPU build by default as `make install` installs (PyPI's Linux wheels are CUDA builds).
ARG TORCH=torch==2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG EXTRAS=hf,peft

ENV PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# torch first, in a layer of its own: the source changes more often than the pin. (DL3013 asks for a pinned version,
# which hadolint cannot see through "$TORCH".)
# hadolint ignore=DL3013
RUN pip install --no-cache-dir "$TORCH" --index-url "$TORCH_INDEX_URL"

WORKDIR /src
COPY pyproject.toml README.md ./
COPY accel_trainer/ accel_trainer/
COPY recipes/ recipes/
COPY accelerate_configs/ accelerate_configs/
# A wheel, not an editable install: the recipes and layouts travel in it as package data.
RUN pip install --no-cache-dir "/src${EXTRAS:+[$EXTRAS]}"

USER 1000:1000
WORKDIR /home/trainer
CMD ["accel-trainer", "list"]
