"""Compiled kernels for where XLA's own code is far from the machine's limit (see `cpu`)."""
