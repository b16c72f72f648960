"""Triton python-backend entry of `chattts_preprocess`: the work is in chattts_triton.runtime."""

import triton_python_backend_utils as pb_utils

from chattts_triton.triton.backend import make_model, preprocess_service

TritonPythonModel = make_model(pb_utils, preprocess_service)
