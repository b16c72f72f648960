"""What the one-process GPU benches (`engine_load`, `codec_load`) share: where they run and what they write."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch


def add_device_args(ap: argparse.ArgumentParser) -> None:
    """--repo, --device, --gpu, --out."""
    ap.add_argument("--repo", type=Path, required=True, help="an exported repository (python -m export)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--gpu", type=int, default=0)
    ap.add_argument("--out", type=Path, help="write the rows as JSON here")


def int_list(ap: argparse.ArgumentParser, text: str, flag: str) -> list:
    """A comma-separated list of whole numbers, or the parser's error naming `flag`."""
    try:
        return [int(v) for v in text.split(",") if v]
    except ValueError:
        ap.error(f"{flag} must be whole numbers, comma-separated")


def cuda_missing(a: argparse.Namespace) -> bool:
    """True (having said so) when --device cuda was asked for on a host without CUDA."""
    if a.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: use --device cpu", file=sys.stderr)
        return True
    return False


def write_rows(a: argparse.Namespace, rows: list, **meta) -> None:
    """The rows as JSON at --out (if given), with the repository, device, versions and command."""
    if not a.out:
        return
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"repo": str(a.repo), "device": a.device, **meta,
                                 "gpu": torch.cuda.get_device_name(a.gpu) if a.device == "cuda" else "cpu",
                                 "torch": torch.__version__, "command": " ".join(sys.argv), "rows": rows}, indent=1))
