"""The pipeline and its users: decode speed, many users and batching, chat turns, speculative decoding, a hop's
and gRPC's overhead, invariance, grammar costs, and the fleet beside llama.cpp's RPC fleet."""
