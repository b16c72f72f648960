"""Starting and supervising `tritonserver`: the launcher (`serve.py`), the server process (`tritonserver.py`) and
CUDA MPS (`mps.py`). It never imports the models' code (or torch)."""
