"""Models and builds: what a build costs (memory, sources), what it keeps (GGUF block types, compression
recipes), how fast its workers start, and greedy parity with llama.cpp on the same GGUF."""
