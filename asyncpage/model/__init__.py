"""Models: one forward over a flat batch (batch.py) on the paged pool. Attention (attention.py, and
attention_triton.py over asyncpage.kernels), layers and families (llama.py, gemma3.py, registry.py),
compiled decode (compiled.py), quantized layers (quant.py, quant_calibrate.py, native.py), weights
and GGUF (weights.py, gguf.py). Never imports guided/, decoding/ or core/."""
