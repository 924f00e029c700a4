"""Fused ops, each beside its pure-torch reference (reference.py); ops.py picks Triton on CUDA and the reference
elsewhere, and is what the model imports."""
