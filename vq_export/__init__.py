"""vq-gguf: VPTQ vector quantization of LLMs into GGUF files that a patched llama.cpp runs.

The package's modules follow the pipeline: calib (text -> token windows), hessian and fisher (what the layer
loss weighs), vptq and kmeans (one linear), quantize (presets; the model block by block, resumable), vqtensor
and pack (codes and side tensors), gguf_writer (the file); then runtime (load and run through cffi), native (the
llama.cpp build) and tools (comparison with llama.cpp's own types). cli is the `vq-gguf` command, api the same
in Python (`from vq_gguf.api import quantize, load, chat`).
"""
