"""Comparison and benchmark scripts: vq-gguf against llama.cpp's own quantizations."""
