"""Pallas (Triton-lowered) kernels for the multi-LoRA ops and the model's decode attention, RMSNorm and small
projections; on CPU they run with `interpret=True`."""

from jlora.pallas.config import ExpandConfig, ShrinkConfig, expand_config, shrink_config
from jlora.pallas.decode_attention import (NewToken, decode_attention, decode_attention_supported,
                                           paged_decode_attention)
from jlora.pallas.dispatch import expand, kernel_rank, linear, shrink, supported
from jlora.pallas.projections import matmul, matmul_add, matmul_supported
from jlora.pallas.rms_norm import add_rms_norm, rms_norm, rms_norm_supported
from jlora.pallas.shrink import shrink_partials

__all__ = [
    "ExpandConfig",
    "NewToken",
    "ShrinkConfig",
    "add_rms_norm",
    "decode_attention",
    "decode_attention_supported",
    "expand",
    "expand_config",
    "kernel_rank",
    "linear",
    "matmul",
    "matmul_add",
    "matmul_supported",
    "paged_decode_attention",
    "rms_norm",
    "rms_norm_supported",
    "shrink",
    "shrink_config",
    "shrink_partials",
    "supported",
]
