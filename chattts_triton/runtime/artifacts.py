"""The exported codec networks as callables: a TorchScript or ONNX artifact, and the reference-audio codes
the DVAE encoder gives (`SPEAKER_AUDIO`, `python -m chattts_triton.voices add --audio`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ..config import LIMITS, SAMPLE_RATE
from ..model.text import InputError


class Artifact:
    """A TorchScript or ONNX artifact called with named tensors, returning torch tensors."""

    def __init__(self, path_stem: Path, fmt: str, device: torch.device):
        self.device = device
        self.fmt = fmt
        if device.type == "cuda":
            # cuDNN's default TF32 convolutions are ~7e-3 off upstream fp32 on the decoders' mels
            torch.backends.cudnn.allow_tf32 = False
        if fmt == "torchscript":
            path = Path(f"{path_stem}.pt")
            self.module = torch.jit.load(str(path), map_location=device).eval()
        elif fmt == "onnx":
            import onnxruntime as ort

            path = Path(f"{path_stem}.onnx")
            providers = ["CPUExecutionProvider"]
            if device.type == "cuda" and "CUDAExecutionProvider" in ort.get_available_providers():
                providers.insert(0, ("CUDAExecutionProvider", {"device_id": device.index or 0, "use_tf32": 0}))
            opts = ort.SessionOptions()
            opts.intra_op_num_threads = max(1, torch.get_num_threads())
            self.session = ort.InferenceSession(str(path), opts, providers=providers)
            self.names = [i.name for i in self.session.get_inputs()]
        else:
            raise ValueError(f"unknown artifact format {fmt!r}: use torchscript or onnx")

    def __call__(self, *args: torch.Tensor) -> torch.Tensor:
        if self.fmt == "torchscript":
            with torch.inference_mode():
                return self.module(*[a.to(self.device) for a in args])
        feeds = {n: a.detach().cpu().numpy() for n, a in zip(self.names, args, strict=True)}
        return torch.from_numpy(self.session.run(None, feeds)[0]).to(self.device)




def check_reference_audio(wav: np.ndarray) -> None:
    """SPEAKER_AUDIO's bounds: 24 kHz mono, 2048 samples to the reference-audio limit, finite."""
    max_n = int(LIMITS.max_reference_audio_seconds * SAMPLE_RATE)
    if wav.size > max_n:
        raise InputError(f"SPEAKER_AUDIO is longer than {LIMITS.max_reference_audio_seconds:g} s at {SAMPLE_RATE} Hz")
    if wav.size < 2048:
        raise InputError("SPEAKER_AUDIO is too short (at least 2048 samples of 24 kHz audio)")
    if not np.isfinite(wav).all():
        raise InputError("SPEAKER_AUDIO holds NaN or Inf")


def reference_codes(encoder: Artifact, wav: np.ndarray) -> np.ndarray:
    """upstream `sample_audio_speaker`'s codes [4, T] of checked reference audio, by the DVAE encoder."""
    codes = encoder(torch.from_numpy(np.ascontiguousarray(wav, dtype=np.float32)).view(1, -1))  # [1, T, 4]
    return codes[0].T.cpu().numpy().astype(np.int64)

