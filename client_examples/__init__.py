"""Client programs for the Triton `llm` model: gRPC chat, HTTP generate(_stream), serving benchmark."""
