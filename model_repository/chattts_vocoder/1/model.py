"""Triton python-backend entry of `chattts_vocoder`: the work is in chattts_triton.services."""

import triton_python_backend_utils as pb_utils

from chattts_triton.backend import vocoder_service, make_model

TritonPythonModel = make_model(pb_utils, vocoder_service)
