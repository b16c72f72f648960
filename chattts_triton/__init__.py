"""Serve ChatTTS on Triton Inference Server. Each wing is a layer; imports only point down (tests/test_layers.py):

    launcher/   serve (python -m chattts_triton.serve), tritonserver, mps: start and supervise Triton
    triton/     backend (the python-backend adapter), deployment (every setting), repo_config and params: the
                models' configurations
    runtime/    what runs inside a Triton model: the services, the in-flight engine, streaming, voices
    model/      ChatTTS in plain PyTorch: the GPT, the codec, sampling, text, speakers, chunking
    config.py   the ground: the contract, shapes, limits, defaults and names; memory.py: GPU memory sizing

serve.py, repo_config.py, voices.py and backend.py here are the commands' and exported repositories' paths.
"""
