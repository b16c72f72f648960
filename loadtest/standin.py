"""A stand-in `chattts` for measuring clients: the ensemble's inputs, an AUDIO answer at once, no model.

    python -m loadtest.standin --out build/standin-repo        # then serve it like any repository:
    python -m chattts_triton.serve --repo build/standin-repo   # (or TritonServer(repo) in a test)

One Triton python-backend model named like the ensemble, with the ensemble's inputs (chattts_triton.config)
and outputs, dynamically batched. Each request gets noise-like float32 samples, as many as MAX_NEW_TOKENS code
frames would make (samples_for_codes; --frames when a request does not say), and SPOKEN_TEXT = its TEXT. With
no GPU work behind it, what a load tool measures against it is the client and Triton's own frontends: e.g.
a response that the HTTP frontend compresses before it sends it (loadtest.http_compare).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from chattts_triton import config as C

NAME = C.ENSEMBLE
DEFAULT_FRAMES = 150
MAX_BATCH = 256

# the model itself: numpy and the stub's utilities only (it runs in Triton's python stub)
MODEL_PY = '''\
import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        params = {k: v["string_value"] for k, v in json.loads(args["model_config"])["parameters"].items()}
        self.hop, self.mels = int(params["hop_length"]), int(params["mel_frames_per_code"])
        self.default_frames = int(params["default_frames"])
        # noise at speech-like level: compresses about as badly as real audio does
        self.noise = (np.random.default_rng(0).standard_normal(self.samples(int(params["max_frames"]))) * 0.1).astype(
            np.float32)

    def samples(self, frames):
        return self.hop * (self.mels * frames - 1) if frames > 0 else 0

    def execute(self, requests):
        responses = []
        for request in requests:
            t = pb_utils.get_input_tensor_by_name(request, "MAX_NEW_TOKENS")
            frames = int(t.as_numpy().reshape(-1)[0]) if t is not None else self.default_frames
            audio = self.noise[: self.samples(max(0, frames))][None, :]
            text = pb_utils.get_input_tensor_by_name(request, "TEXT").as_numpy().reshape(1, 1)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("AUDIO", audio),
                                                         pb_utils.Tensor("SPOKEN_TEXT", text.astype(np.object_))]))
        return responses
'''


def _dims(dims: Sequence[int]) -> str:
    return "".join(f"  dims: {d}\n" for d in dims)


def config_pbtxt(default_frames: int = DEFAULT_FRAMES, max_frames: int = C.LIMITS.max_new_tokens) -> str:
    lines = [f'name: "{NAME}"\nbackend: "python"\nmax_batch_size: {MAX_BATCH}\n']
    for name, (dtype, dims, required) in C.ENSEMBLE_INPUTS.items():
        allow = "" if list(dims) == [1] else "  allow_ragged_batch: true\n"
        lines.append(f'input {{\n  name: "{name}"\n  data_type: {dtype}\n{_dims(dims)}'
                     f'{"" if required else "  optional: true" + chr(10)}{allow}}}\n')
    for name, (dtype, dims) in C.ENSEMBLE_OUTPUTS.items():
        lines.append(f'output {{\n  name: "{name}"\n  data_type: {dtype}\n{_dims(dims)}}}\n')
    lines.append("instance_group {\n  count: 1\n  kind: KIND_CPU\n}\ndynamic_batching {\n}\n")
    params = {"hop_length": C.HOP_LENGTH, "mel_frames_per_code": C.MEL_FRAMES_PER_CODE,
              "default_frames": default_frames, "max_frames": max_frames}
    for key, value in params.items():
        lines.append(f'parameters {{\n  key: "{key}"\n  value {{\n    string_value: "{value}"\n  }}\n}}\n')
    return "".join(lines)


def write_repo(out: Path, default_frames: int = DEFAULT_FRAMES) -> Path:
    """The stand-in repository under `out` (created; an existing stand-in there is overwritten)."""
    if default_frames < 1:
        raise ValueError(f"default_frames must be >= 1, got {default_frames}")
    model = Path(out) / NAME
    (model / "1").mkdir(parents=True, exist_ok=True)
    (model / "config.pbtxt").write_text(config_pbtxt(default_frames), encoding="utf-8")
    (model / "1" / "model.py").write_text(MODEL_PY, encoding="utf-8")
    return Path(out)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.standin", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("build/standin-repo"))
    p.add_argument("--frames", type=int, default=DEFAULT_FRAMES, help="audio of a request without MAX_NEW_TOKENS")
    a = p.parse_args(argv)
    if a.frames < 1:
        p.error("--frames must be >= 1")
    print(write_repo(a.out, a.frames))
    return 0


if __name__ == "__main__":
    sys.exit(main())
