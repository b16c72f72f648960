"""Triton python-backend entry of `chattts_gpt`: the work is in chattts_triton.runtime."""

import triton_python_backend_utils as pb_utils

from chattts_triton.triton.backend import gpt_service, make_model

TritonPythonModel = make_model(pb_utils, gpt_service)
