"""Fused GPU kernels for the serving hot path (Triton), each with a tested CPU reference."""
