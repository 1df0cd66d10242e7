"""Kernels and memory: fleet's GGUF kernels beside llama.cpp per product and per model, weight layouts and forms,
MoE and sliding-window KV, in-process shard parity, and what a worker holds in memory."""
