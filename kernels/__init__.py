"""Attention kernels and their PyTorch references."""
