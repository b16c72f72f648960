"""Triton itself: the python-backend adapter (`backend.py`) and the model configurations (`repo_config.py`, with
each model's parameters in `params.py` and every setting of a deployment, its flag and default, in `deployment.py`)."""
