"""Inductor's coordinate-descent tuning, kept to the kernels it can tune without touching the engine's state.

At one row the decode step is a chain of small reductions (`ChatTTSGPT.set_gemv`: each projection fused with the
norm or activation around it) whose launch configuration inductor picks by a heuristic made for larger reductions.
`torch.compile(options=ONE_ROW_OPTIONS)` has it try the neighbours of each kernel's configuration on the real
arguments at the kernel's first run (the warm-up) and keep the fastest; the choice is stored in inductor's cache, so
a later start with the same cache reads it instead of tuning again.

Trying a configuration runs the kernel, so inductor clones every argument the kernel writes in place before each
try. For the step's writes into the KV cache, the hidden states and the token history that is gigabytes per try
(minutes, and memory the card does not have), so `tune_pure_kernels_only` patches inductor's autotuner to leave such
kernels at their heuristic configuration: only kernels that write nothing larger than `MAX_CLONED_BYTES` are tuned.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

log = logging.getLogger(__name__)

ONE_ROW_OPTIONS = {"coordinate_descent_tuning": True}
# a kernel writing in place to more than this is left untuned (the KV cache, hidden states, tokens: GBs at
# serving sizes); the reductions' own outputs and inductor's reused scratch buffers are far smaller
MAX_CLONED_BYTES = 16 << 20
PATCH_MARK = "_chattts_pure_only"


def written_bytes(arg_names: Sequence[str], mutated: Sequence[str], args: Sequence[Any]) -> int:
    """The bytes of the tensors among `args` (named `arg_names`) that the kernel writes in place (`mutated`)."""
    wrote = set(mutated)
    total = 0
    for name, arg in zip(arg_names, args, strict=False):  # inductor may pass fewer names than arguments
        if name in wrote and hasattr(arg, "untyped_storage"):
            total += arg.numel() * arg.element_size()
    return total


def tune_pure_kernels_only(cls: Any = None) -> bool:
    """Patch `cls` (inductor's `CachingAutotuner` by default) so that its coordinate-descent tuning skips kernels
    that write more than MAX_CLONED_BYTES in place, and keeps a kernel's heuristic configuration (logged) where
    tuning fails. Idempotent. False where this torch has no such hook (tuning then stays off: see `one_row_options`)."""
    if cls is None:
        try:
            from torch._inductor.runtime.triton_heuristics import CachingAutotuner as cls
        except ImportError:  # pragma: no cover - depends on the torch build
            return False
    orig = getattr(cls, "coordinate_descent_tuning", None)
    if orig is None:
        return False
    if getattr(orig, PATCH_MARK, False):
        return True

    def coordinate_descent_tuning(self, launcher, *args, **kwargs):
        names = list(getattr(getattr(self, "fn", None), "arg_names", ()) or ())
        mutated = list(getattr(self, "mutated_arg_names", ()) or ())
        # arguments without names cannot be sized: a kernel that writes any of them is left alone
        if mutated and (not names or written_bytes(names, mutated, args) > MAX_CLONED_BYTES):
            launcher.config.found_by_coordesc = True  # settled: `run` does not ask again at every launch
            return launcher
        try:
            return orig(self, launcher, *args, **kwargs)
        except Exception:
            log.warning("coordinate-descent tuning of %s failed; it keeps its heuristic configuration",
                        getattr(self, "inductor_meta", {}).get("kernel_name", "a kernel"), exc_info=True)
            launcher.config.found_by_coordesc = True
            return launcher

    setattr(coordinate_descent_tuning, PATCH_MARK, True)
    cls.coordinate_descent_tuning = coordinate_descent_tuning
    return True


def one_row_options(backend: Any) -> dict:
    """torch.compile's options for the one-row step: tuned where the backend is inductor and the hook exists."""
    if backend != "inductor" or not tune_pure_kernels_only():
        return {}
    return {"options": dict(ONE_ROW_OPTIONS)}
