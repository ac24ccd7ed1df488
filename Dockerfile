# The rankwatch daemon image (examples/kubernetes/rankwatch-daemonset.yaml): rankwatch, py-spy (a
# dependency), and torch's CPU build (the cross-node store is torch's TCPStore; the daemon never uses a GPU
# through torch, it reads NVML from the host driver that the NVIDIA container runtime mounts).
#
#   docker build -t ghcr.io/your-org/rankwatch:0.1.0 .
#
# Runs as root in the pod with only the capabilities the DaemonSet adds (SYS_PTRACE, DAC_READ_SEARCH,
# KILL) and a read-only root filesystem; docs/operations.md "Kubernetes".
ARG PYTHON_VERSION=3.11
FROM python:${PYTHON_VERSION}-slim-bookworm

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    # NVML inside the container: the NVIDIA container runtime mounts the driver's libnvidia-ml (as for
    # dcgm-exporter); "utility" is NVML only, no CUDA
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=utility

# torch first, from the CPU index: a layer that changes only with TORCH_VERSION
RUN python -m pip install --index-url "${TORCH_INDEX}" "torch==${TORCH_VERSION}"

WORKDIR /src
COPY pyproject.toml README.md ./
COPY hooks/ hooks/
COPY watchdog/ watchdog/
RUN python -m pip install . \
    && rm -rf /src \
    && rankwatch --version

WORKDIR /
USER 0:0
EXPOSE 9431
CMD ["rankwatch", "daemon", "--json-logs", "--shm-dir", "/dev/shm/rankwatch", "--out", "/var/lib/rankwatch"]
