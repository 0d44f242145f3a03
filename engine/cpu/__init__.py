"""The CPU lane: GGUF-quantized linears and the numba kernels behind them."""
