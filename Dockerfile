# The training image: preftune with its S3 and LoRA extras on a CUDA build of PyTorch.
#   docker build -t preftune:latest .
# then push it to your registry and set deploy.image to that name.
# Any CUDA build of PyTorch >= 2.4 works as the base: --build-arg BASE_IMAGE=pytorch/pytorch:TAG
ARG BASE_IMAGE=pytorch/pytorch:2.7.1-cuda12.8-cudnn9-runtime
FROM ${BASE_IMAGE}

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1

WORKDIR /app
COPY pyproject.toml README.md ./
COPY preftune ./preftune
COPY examples ./examples
# vllm (grpo.use_vllm) pins its own CUDA build of torch, which replaces the base image's; without
# the engine: --build-arg EXTRAS=s3,lora keeps the base image's torch
ARG EXTRAS=s3,lora,vllm
RUN pip install ".[${EXTRAS}]"

# the same uid/gid the rendered pods run as (securityContext runAsUser/fsGroup 1000)
# (some base images already have a uid 1000: reuse it)
RUN (getent group 1000 || groupadd --gid 1000 preftune) \
    && (getent passwd 1000 || useradd --uid 1000 --gid 1000 --no-create-home preftune) \
    && mkdir -p /home/preftune && chown -R 1000:1000 /app /home/preftune
USER 1000:1000
ENV HOME=/home/preftune HF_HOME=/home/preftune/.cache/huggingface

ENTRYPOINT ["preftune"]
CMD ["--help"]
