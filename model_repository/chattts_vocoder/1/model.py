"""Triton python-backend entry of `chattts_vocoder`: the work is in chattts_triton.runtime."""

import triton_python_backend_utils as pb_utils

from chattts_triton.triton.backend import make_model, vocoder_service

TritonPythonModel = make_model(pb_utils, vocoder_service)
