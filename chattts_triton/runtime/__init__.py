"""What runs inside a Triton model process: the services each model hosts, the in-flight engine, streaming and
the voice registry. Nothing here imports Triton: `triton/backend.py` adapts it."""
