"""Native kernels for XLA:CPU, compiled from source on first use and called through XLA's FFI (issue 12:
the training attention; issue 26: decode attention over the stacked KV cache)."""
