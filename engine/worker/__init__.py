"""Running the model: the model runner, KV pool sizing, CUDA graphs, memory and CPU threads."""
