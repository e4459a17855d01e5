# The training image: preftune with its S3 and LoRA extras on a CUDA build of PyTorch.
#   docker build -t preftune:latest .
# then push it to your registry and set deploy.image to that name.
FROM pytorch/pytorch:2.7.1-cuda12.8-cudnn9-runtime

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1

WORKDIR /app
COPY pyproject.toml README.md ./
COPY preftune ./preftune
COPY examples ./examples
# torch comes from the base image (CUDA build); pip keeps it since it satisfies torch>=2.4
RUN pip install ".[s3,lora]"

# the same uid/gid the rendered pods run as (securityContext runAsUser/fsGroup 1000)
RUN groupadd --gid 1000 preftune && useradd --uid 1000 --gid 1000 --create-home preftune \
    && chown -R preftune:preftune /app
USER 1000:1000
ENV HOME=/home/preftune HF_HOME=/home/preftune/.cache/huggingface

ENTRYPOINT ["preftune"]
CMD ["--help"]
