"""ChatTTS in plain PyTorch, without Triton: the GPT, the codec, sampling, text and speakers."""
