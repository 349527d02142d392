"""KV pool sizing as vLLM does it: memory left after the weights, in pages (no jax)."""

from __future__ import annotations

from typing import Optional

from cbjax.config import HardwareConfig, ModelConfig


def auto_num_pages(
    model: ModelConfig, hw: HardwareConfig, page_size: int, memory_utilization: float,
    draft: Optional[ModelConfig] = None,
) -> int:
    """Pages (the null page among them) that fit in `memory_utilization` of the devices'
    memory once the weights are loaded: floor((mem_bytes x num_devices x utilization -
    weight bytes) / KV bytes per page). Like vLLM's profiling run, minus the activations'
    peak, which the simulator does not model. A separate draft model (speculative decoding,
    `spec.draft_model`) adds its weights, and its K/V to every page: its pool shares the
    target's page tables."""
    weight_bytes = model.num_params * model.dtype_bytes
    page_bytes = model.kv_bytes_per_token * page_size
    if draft is not None:
        weight_bytes += draft.num_params * draft.dtype_bytes
        page_bytes += draft.kv_bytes_per_token * page_size
    budget = hw.mem_bytes * hw.num_devices * memory_utilization - weight_bytes
    num_pages = int(budget // page_bytes)
    if num_pages < 2:
        raise ValueError(
            f"cache.num_pages=auto: {hw.num_devices} x {hw.name} at cache.memory_utilization="
            f"{memory_utilization} leaves {max(budget, 0) / 1e9:.2f} GB after {weight_bytes / 1e9:.2f} GB of "
            f"model {model.name} weights, under 2 pages of {page_bytes} bytes"
        )
    return num_pages
