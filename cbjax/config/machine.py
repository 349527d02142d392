"""The model and hardware groups: what the engine runs and what the roofline cost model charges
(the stack's own host costs are the overhead group's, `cbjax.config.overhead`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from cbjax.config.checks import _one_of, _require

DTYPES = ("float32", "bfloat16")
ROPE_TYPES = ("default", "linear", "llama3")  # cbjax.model.ops.RopeScaling's kinds, and none
# Each MLP kind's weight matrices per layer: gated (SwiGLU, Llama) gate, up and down; plain (OPT) up and down.
MLP_MATRICES = {"gated": 3, "plain": 2}
MLP_KINDS = tuple(MLP_MATRICES)


@dataclass
class ModelConfig:
    """A Llama-family decoder. Used by the JAX engine and by the roofline cost model."""

    name: str = "tiny"
    vocab_size: int = 512
    d_model: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    ffn_dim: int = 128
    rope_theta: float = 10000.0
    # RoPE scaling past the training context, as Hugging Face's rope_type names it: "default"
    # (none), "linear" or "llama3" (cbjax.model.ops.RopeScaling), with its factor, low and high
    # frequency factors (llama3) and original_max_position_embeddings (llama3)
    rope_type: str = "default"
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_len: int = 8192
    max_model_len: int = 1024
    tie_embeddings: bool = False
    dtype: str = "float32"
    mlp: str = "gated"  # gated: SwiGLU (Llama); plain: two matrices (OPT)
    attention_bias: bool = False  # Qwen2 has q/k/v biases
    o_proj_bias: bool = False  # Llama checkpoints with attention_bias also bias o_proj
    mlp_bias: bool = False  # Llama's mlp_bias: gate/up/down biases
    norm_eps: float = 1e-5
    eos_token_id: Optional[int] = None
    # further tokens that end a request as eos_token_id does: the rest of generation_config.json's
    # eos list (Llama 3 Instruct stops on <|eot_id|> as well as <|end_of_text|>)
    extra_eos_token_ids: list[int] = field(default_factory=list)
    # A local Hugging Face model directory (config.json, *.safetensors, maybe tokenizer.json).
    # Its config.json sets the architecture fields; with it, dtype "auto" and max_model_len 0
    # mean "the checkpoint's" (see cbjax.model.hf).
    path: Optional[str] = None

    def __post_init__(self) -> None:
        if self.dtype == "auto" and self.max_model_len == 0:  # model=hf's defaults
            _require(bool(self.path), "model.path", "is required by model=hf (dtype auto, max_model_len 0)", self.path)
        elif self.dtype == "auto":
            _require(bool(self.path), "model.dtype", "auto (the checkpoint's) needs model.path", self.dtype)
        elif self.max_model_len == 0:
            _require(bool(self.path), "model.max_model_len", "0 (the checkpoint's) needs model.path; else must be >= 2",
                     self.max_model_len)  # fmt: skip
        _one_of("model.dtype", self.dtype, DTYPES + (("auto",) if self.path else ()))
        _one_of("model.mlp", self.mlp, MLP_KINDS)
        _one_of("model.rope_type", self.rope_type, ROPE_TYPES)
        if self.rope_type != "default":
            _require(self.rope_factor > 0, "model.rope_factor", "must be > 0", self.rope_factor)
        if self.rope_type == "llama3":
            _require(self.rope_low_freq_factor > 0, "model.rope_low_freq_factor", "must be > 0", self.rope_low_freq_factor)
            _require(
                self.rope_high_freq_factor > self.rope_low_freq_factor,
                "model.rope_high_freq_factor",
                f"must exceed model.rope_low_freq_factor ({self.rope_low_freq_factor})",
                self.rope_high_freq_factor,
            )
            _require(self.rope_original_max_len >= 1, "model.rope_original_max_len", "must be >= 1", self.rope_original_max_len)
        for key in ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads", "head_dim", "ffn_dim"):
            value = getattr(self, key)
            _require(value >= 1, f"model.{key}", "must be >= 1", value)
        if not (self.path and self.max_model_len == 0):
            _require(self.max_model_len >= 2, "model.max_model_len", "must be >= 2", self.max_model_len)
        _require(
            self.num_heads % self.num_kv_heads == 0,
            "model.num_heads",
            f"must be a multiple of model.num_kv_heads ({self.num_kv_heads})",
            self.num_heads,
        )

    @property
    def dtype_bytes(self) -> int:
        return 4 if self.dtype == "float32" else 2

    @property
    def num_params(self) -> int:
        """Parameter count, embeddings and LM head included."""
        d, hd = self.d_model, self.head_dim
        attn = d * self.num_heads * hd * 2 + d * self.num_kv_heads * hd * 2
        mlp = d * self.ffn_dim * MLP_MATRICES[self.mlp]
        embed = self.vocab_size * d * (1 if self.tie_embeddings else 2)
        return self.num_layers * (attn + mlp + 2 * d) + embed + d

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    def unsplit_by(self, tensor: int) -> Optional[str]:
        """The first axis a tensor-parallel mesh of `tensor` devices splits (KV heads, query
        heads, the MLP's hidden width) that `tensor` does not divide, or None."""
        return next((key for key in ("num_kv_heads", "num_heads", "ffn_dim") if getattr(self, key) % tensor), None)


@dataclass
class HardwareConfig:
    """An accelerator for the roofline cost model. Figures come from public datasheets only; a
    serving stack's host costs are the `overhead` group's (`cbjax.config.overhead`)."""

    name: str = "a100_80gb"
    peak_flops: float = 312e12  # dense bf16 tensor-core FLOP/s
    mem_bw: float = 2.039e12  # HBM bytes/s
    mem_bytes: float = 80e9
    flops_efficiency: float = 0.6  # achievable fraction of peak_flops
    bw_efficiency: float = 0.8  # achievable fraction of mem_bw
    # Host<->device bytes/s for swap preemption. PCIe 4.0 x16 carries 31.5 GB/s each way
    # (16 GT/s x 16 lanes, 128b/130b encoding; PCI-SIG PCIe 4.0 spec); pinned copies reach ~25.
    host_bw: float = 25e9
    # Tensor parallelism over num_devices identical devices (the figures above are per device):
    # weights, KV and FLOPs split evenly; two ring all-reduces of the activations per layer
    # over interconnect_bw (bytes/s each way per device, e.g. NVLink).
    num_devices: int = 1
    interconnect_bw: float = 300e9

    def __post_init__(self) -> None:
        _require(self.num_devices >= 1, "hardware.num_devices", "must be >= 1", self.num_devices)
        for key in ("peak_flops", "mem_bw", "mem_bytes", "host_bw", "interconnect_bw"):
            value = getattr(self, key)
            _require(value > 0, f"hardware.{key}", "must be > 0", value)
        for key in ("flops_efficiency", "bw_efficiency"):
            value = getattr(self, key)
            _require(0 < value <= 1, f"hardware.{key}", "must be in (0, 1]", value)
