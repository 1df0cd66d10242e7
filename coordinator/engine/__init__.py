"""The generation engine: admission (``engine``), the step loop and its scheduler, batch groups, the stage
pipeline, the output processor, sampling, speculative decoding, grammar constraints and the prefix cache."""
