"""Triton python-backend entry of `chattts_stream`: the work is in chattts_triton.streaming."""

import triton_python_backend_utils as pb_utils

from chattts_triton.backend import stream_service, make_model

TritonPythonModel = make_model(pb_utils, stream_service)
