# mig-exporter: NVIDIA GPU memory per card, per MIG instance and per process.
#
# The image carries no NVIDIA driver: nvidia-smi and libnvidia-ml.so.1 come from
# the host's driver through the NVIDIA container toolkit, which mounts them when
# the container runs with NVIDIA_VISIBLE_DEVICES=all and
# NVIDIA_DRIVER_CAPABILITIES=utility (set below; on Kubernetes use the nvidia
# runtime class or the GPU Operator's toolkit). See README.md, "Deploy".
ARG BASE_IMAGE=debian:12.11-slim

FROM ${BASE_IMAGE} AS build
# Behind a TLS-intercepting proxy, pass its CA bundle: --build-arg PIP_CERT=/path
# with the file mounted into the build (the build stage only; not in the image).
ARG PIP_CERT
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3=3.11.2-1+b1 python3-venv=3.11.2-1+b1 \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml README.md ./
COPY src ./src
RUN python3 -m venv /opt/mig-exporter \
    && /opt/mig-exporter/bin/python -m pip install --no-cache-dir /src \
    && /opt/mig-exporter/bin/mig-exporter --version

FROM ${BASE_IMAGE}
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3=3.11.2-1+b1 \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /opt/mig-exporter /opt/mig-exporter
ENV PATH=/opt/mig-exporter/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=utility
# nobody: reading GPU memory needs no privilege. Seeing every MIG instance needs the MIG
# monitor capability: NVIDIA_MIG_MONITOR_DEVICES=all, which the NVIDIA runtime hook only
# accepts with SYS_ADMIN in the container's bounding set (docs/mig-monitor.md).
USER 65534:65534
EXPOSE 10064
ENTRYPOINT ["mig-exporter"]
CMD ["serve"]
