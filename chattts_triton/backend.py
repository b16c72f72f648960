"""The adapter's first path, which the `model.py` of repositories exported before the package had wings import:
they keep loading. The adapter is `triton/backend.py`."""

from .triton.backend import gpt_service, make_model, preprocess_service, stream_service, vocoder_service

__all__ = ["gpt_service", "make_model", "preprocess_service", "stream_service", "vocoder_service"]
