"""Jupyter kernel lifecycle, the in-kernel runtime and the kernel-to-host bridge."""
