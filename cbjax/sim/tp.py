"""Tensor-parallel communication per step, shared by the roofline model and the engine's check.

A Megatron-style layer ends its attention block and its MLP block with one all-reduce each
of the [tokens, d_model] activations (cbjax.runtime.mesh), so a step of T tokens all-reduces
2 * num_layers * T * d_model values. A ring all-reduce over n devices sends (and receives)
2(n-1)/n of the payload per device.
"""

from __future__ import annotations

from cbjax.config import ModelConfig


def allreduces_per_step(model: ModelConfig) -> int:
    """All-reduce operations per step: one after attention and one after the MLP, per layer."""
    return 2 * model.num_layers


def allreduce_bytes_per_token(model: ModelConfig) -> int:
    """Bytes all-reduced per token of a step (the operands' size, all layers together)."""
    return allreduces_per_step(model) * model.d_model * model.dtype_bytes


def ring_bytes_per_device(payload_bytes: float, num_devices: int) -> float:
    """Bytes each device sends in a ring all-reduce of `payload_bytes` over `num_devices`."""
    return 2.0 * (num_devices - 1) / num_devices * payload_bytes
