"""Triton itself: the python-backend adapter (`backend.py`) and the model configurations (`repo_config.py`, with
each model's parameters in `params.py` and every setting of a deployment, its flag and default, in `deployment.py`).

Why this wing keeps the name `triton`, beside the `triton` kernel language that `model/attention.py` imports:
every exported model repository's `model.py` (copied from `model_repository/*/1/model.py` by `export`) imports
`chattts_triton.triton.backend`, so repositories users exported earlier name this module; a rename would break
them or leave a second name for the same layer. For Python the two never meet: this package is only ever
reached as `chattts_triton.triton` (or `.triton` from inside `chattts_triton`), and a plain `import triton`
anywhere is the kernel language."""
