"""An OpenAI-compatible HTTP service (/v1/completions, /v1/chat/completions, /v1/models,
/health) in front of Triton's `llm` model, as a gRPC client of the server:
`python -m openai_frontend --triton-grpc localhost:8001 --port 9000`."""
