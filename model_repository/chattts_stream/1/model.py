"""Triton python-backend entry of `chattts_stream`: the work is in chattts_triton.runtime.streaming."""

import triton_python_backend_utils as pb_utils

from chattts_triton.triton.backend import make_model, stream_service

TritonPythonModel = make_model(pb_utils, stream_service)
