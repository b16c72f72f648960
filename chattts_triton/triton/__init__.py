"""Triton itself: the python-backend adapter (`backend.py`) and the model configurations (`repo_config.py`, with
each model's parameters in `params.py`)."""
