"""Which devices each replica process owns, as the environment it starts with (no jax: the
driver must not start a jax backend, which on a GPU would take the devices for itself).

- GPUs (`CUDA_VISIBLE_DEVICES`, else the ones `nvidia-smi` lists, unless `JAX_PLATFORMS`
  rules CUDA out): replica i gets `CUDA_VISIBLE_DEVICES` set to its own `tensor[i]` GPUs, after
  those of the replicas before it, so its jax sees only them.
- CPU: replica i gets `tensor[i]` forced XLA:CPU devices
  (`XLA_FLAGS=--xla_force_host_platform_device_count=N`, any count the driver had replaced)
  and `JAX_PLATFORMS=cpu`. The replicas share the host's cores.
- TPU chips are not split between processes here.
"""

from __future__ import annotations

import glob
import shutil
import subprocess
from typing import Mapping, Optional

FORCE_COUNT = "--xla_force_host_platform_device_count"


def visible_gpus(environ: Mapping[str, str]) -> Optional[list[str]]:
    """The GPUs the run may use (ids as CUDA_VISIBLE_DEVICES takes them), or None to run on CPU."""
    platforms = environ.get("JAX_PLATFORMS", "").lower()
    if "tpu" in platforms or (not platforms and glob.glob("/dev/accel[0-9]*")):
        raise ValueError(
            "cluster.backend=processes: TPU chips are not split between replica processes; "
            "use cluster.backend=inline (every replica in this process)"
        )
    if platforms and not any(p in platforms for p in ("cuda", "gpu")):
        return None
    if "CUDA_VISIBLE_DEVICES" in environ:
        ids = [d.strip() for d in environ["CUDA_VISIBLE_DEVICES"].split(",") if d.strip()]
        return ids or None
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run([smi, "--query-gpu=index", "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    ids = [line.strip() for line in out.stdout.splitlines() if line.strip()] if out.returncode == 0 else []
    return ids or None


def replica_environments(tensors: list[int], environ: Mapping[str, str], gpus: Optional[list[str]]) -> list[dict[str, str]]:
    """The variables to set in each replica's process: replica i owns `tensors[i]` devices,
    disjoint from the others' (`gpus`: `visible_gpus`, None on CPU)."""
    if gpus is None:
        kept = [f for f in environ.get("XLA_FLAGS", "").split() if not f.startswith(FORCE_COUNT)]
        return [{"JAX_PLATFORMS": "cpu", "XLA_FLAGS": " ".join([*kept, f"{FORCE_COUNT}={n}"])} for n in tensors]
    if sum(tensors) > len(gpus):
        raise ValueError(
            f"cluster.replicas: {len(tensors)} replicas of executor.mesh.tensor {tensors} need {sum(tensors)} "
            f"GPUs, but only {len(gpus)} are visible ({','.join(gpus)})"
        )
    out, lo = [], 0
    for n in tensors:
        out.append({"CUDA_VISIBLE_DEVICES": ",".join(gpus[lo : lo + n])})
        lo += n
    return out
