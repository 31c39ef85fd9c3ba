"""The pooling runner (vLLM's runner="pooling"): embeddings and cross-encoder scores.

Torch-free here: params.py (PoolingParams), outputs.py (vLLM's output shapes),
settings.py (what a model folder says about pooling), scheduler.py (the scheduler's
pooling rules), inputs.py (prompt checks), offline.py (LLM.embed / LLM.score). With
torch: pooler.py (pooling methods and heads), batch.py (a step's inputs), loader.py,
startup.py and engine.py (the engine loop LLMEngine hands pooling calls to); the runner
is engine/worker/pooling_runner.py, the encoders engine/models/bert.py."""
