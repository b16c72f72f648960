"""Can this torch load an AOTInductor package of the decode step, and is it faster than the compiled step?

One package per (batch bucket, attention length): `torch.export` of `Engine.step_core` (embedding, GPT,
heads, sampling, the state writes) with the engine's state tensors as inputs it mutates in place, compiled
ahead of time by `torch._inductor.aoti_compile_and_package` and loaded with `aoti_load_package`.
`AotiStep` takes the place of the compiled step (`Engine.graph_step`), so the engine's CUDA graphs replay
it exactly as they replay the torch.compile step, and `bench.probes.step` times both the same way.

kernel: how the decode attention reaches the package on a GPU — "op": the custom operator
(`torch.ops.chattts_triton.decode_attention`, called back through the dispatcher), "traced": the Triton
kernel itself, compiled into the package (static shapes: specialised on the real strides). On a CPU both
are the PyTorch reference.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import torch
from torch import Tensor, nn

# the engine state a decode step reads and writes (Engine._alloc): the packed row state (`RowParams`'s two
# tensors; `n_dev` is a view of its count column), then these
STATE = ("tokens", "hiddens", "k_cache", "v_cache", "block_table")
KERNELS = ("op", "traced")
# a package is loaded in a fresh process first: on the H200 (torch 2.11 cu130, 2026-12-02) torch's loader
# died of SIGSEGV in `_load_aoti`, taking the whole bench with it; now that fails its variant only (and
# `probe` showed that loader crashing on a two-layer package there too)
LOAD_CHECK = ("import sys, torch, chattts_triton.model.attention; "  # the package calls back the decode-attention op
              "torch._inductor.aoti_load_package(sys.argv[1], run_single_threaded=True)")


def state_tensors(engine) -> tuple[Tensor, ...]:
    """The step's state tensors in the order `_StepModule.forward` takes them."""
    return (engine.row_params.ints, engine.row_params.floats) + tuple(getattr(engine, name) for name in STATE)


class _StepModule(nn.Module):
    """`engine.step_core(0, b, attn_len, "code", n_live)` as a function of the state tensors."""

    def __init__(self, engine, b: int, attn_len: int):
        super().__init__()
        self.model = engine.model  # registered: its weights become the package's constants
        self.engine, self.b, self.attn_len = engine, b, attn_len

    def forward(self, ints: Tensor, floats: Tensor, tokens: Tensor, hiddens: Tensor, k_cache: Tensor,
                v_cache: Tensor, block_table: Tensor, n_live: Tensor) -> Tensor:
        from chattts_triton.runtime.row_params import RowParams

        e = self.engine
        saved = {name: getattr(e, name) for name in STATE + ("row_params", "n_dev")}
        try:
            e.tokens, e.hiddens, e.k_cache, e.v_cache, e.block_table = tokens, hiddens, k_cache, v_cache, block_table
            e.row_params = RowParams(ints, floats)
            e.n_dev = e.row_params.n
            return e.step_core(0, self.b, self.attn_len, "code", n_live)
        finally:
            for name, value in saved.items():
                setattr(e, name, value)


@contextmanager
def _attention_kernel(kernel: str):
    """"traced": the GPT calls the Triton launcher directly, so export records the kernel itself."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    if kernel == "op":
        yield
        return
    from chattts_triton.model import attention

    def direct(q, keys, values, tables, lengths):
        if not attention.kernel_available(q.device, q.shape[-1]):
            return attention.reference(q, keys, values, tables, lengths)
        return attention.run_kernel(q, keys, values, tables, lengths, traceable=True)

    with mock.patch("chattts_triton.model.gpt.decode_attention", direct):
        yield


def package_step(engine, b: int, attn_len: int, path: Path, kernel: str = "op") -> Path:
    """Export and compile the decode step of b rows at attn_len into the package `path`."""
    if isinstance(engine.model, torch.jit.ScriptModule):
        raise ValueError("an AOTInductor package is exported from the eager GPT module, not TorchScript")
    state = state_tensors(engine)
    n_live = torch.tensor(b, dtype=torch.int64, device=engine.device)
    with _attention_kernel(kernel), torch.no_grad():
        ep = torch.export.export(_StepModule(engine, b, attn_len), state + (n_live,), strict=False)
        path.parent.mkdir(parents=True, exist_ok=True)
        # no pointwise autotuning: it clones a kernel's in-place arguments per tried config, here the
        # whole KV cache (as Engine.compile_step says)
        return Path(torch._inductor.aoti_compile_and_package(ep, package_path=str(path),
                                                             inductor_configs={"triton.autotune_pointwise": False}))


def _signal_name(n: int) -> str:
    try:
        return signal.Signals(n).name
    except ValueError:  # real-time signals have no name
        return f"signal {n}"


def _child_output(stderr) -> str:
    """The child's last lines, and the line that names a fatal error if it is earlier (faulthandler's
    stack and module list can run past the tail)."""
    if isinstance(stderr, bytes):
        stderr = stderr.decode(errors="replace")
    lines = [line.strip() for line in (stderr or "").splitlines() if line.strip()]
    fatal = [line for line in lines[:-6] if line.startswith("Fatal Python error")][:1]
    return " | ".join(fatal + lines[-6:])


def check_loads(path: Path, timeout_s: float = 600.0) -> None:
    """Load the package `path` in a fresh Python process; RuntimeError (with the child's last output) if
    that fails, dies of a signal or hangs past `timeout_s`. It catches what a fresh process meets: a crash
    that only the calling process's own state brings about still happens in `AotiStep.runner`'s load."""
    path = Path(path).resolve()  # the child runs in the package's folder
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    try:  # cwd: a core file of a crash lands beside the package, not in the working tree
        r = subprocess.run([sys.executable, "-X", "faulthandler", "-c", LOAD_CHECK, str(path)], env=env,
                           cwd=str(path.parent), capture_output=True, text=True, errors="replace",
                           timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(f"loading the AOTInductor package {path.name} in a fresh process took over "
                           f"{timeout_s:.0f} s: {_child_output(e.stderr)}") from None
    if r.returncode == 0:
        return
    how = f"killed it ({_signal_name(-r.returncode)})" if r.returncode < 0 else f"failed (exit {r.returncode})"
    raise RuntimeError(f"loading the AOTInductor package {path.name} in a fresh process {how}: "
                       f"{_child_output(r.stderr)}")


class AotiStep:
    """`Engine.graph_step` from AOTInductor packages, one per (batch bucket, attention length), built
    the first time a bucket is met: `build_s` (export + compile, what `python -m export` would pay) and
    `load_s` (what a server's start-up would pay instead of torch.compile's) per bucket. Each package is
    loaded in a fresh process first (`check_loads`), so one whose load crashes any process raises here instead."""

    def __init__(self, engine, workdir: Path, kernel: str = "op"):
        self.engine, self.workdir, self.kernel = engine, Path(workdir), kernel
        self.runners: dict[tuple[int, int], Callable] = {}
        self.build_s: dict[tuple[int, int], float] = {}
        self.load_s: dict[tuple[int, int], float] = {}

    def runner(self, b: int, attn_len: int) -> Callable:
        key = (b, attn_len)
        if key not in self.runners:
            t0 = time.perf_counter()
            path = package_step(self.engine, b, attn_len, self.workdir / f"step-b{b}-l{attn_len}-{self.kernel}.pt2",
                                self.kernel)
            t1 = time.perf_counter()
            check_loads(path)
            t2 = time.perf_counter()
            # single-threaded runs: the default records and waits on an event around each run, which a
            # CUDA graph capture of it would hold (torch's own advice with CUDA graphs)
            self.runners[key] = torch._inductor.aoti_load_package(str(path), run_single_threaded=True)
            self.build_s[key], self.load_s[key] = t1 - t0, time.perf_counter() - t2
        return self.runners[key]

    def __call__(self, start: int, b: int, attn_len: int, mode: str = "code", n_live: Tensor = None) -> Tensor:
        if start != 0 or mode != "code" or n_live is None:
            raise ValueError("an AOTInductor step serves audio-code graph buckets (start 0, n_live given)")
        e = self.engine
        return self.runner(b, attn_len)(*state_tensors(e), n_live)


def probe(workdir: Path, device: str) -> Path:
    """Whether this torch can load any AOTInductor package: a two-layer model packaged for `device` and
    loaded in a fresh process (`check_loads`: RuntimeError if not). Tells a crash of torch's loader on the
    host from one of the step's packages (on the H200 host, 2026-12-02: SIGSEGV for both)."""
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU()).to(device).eval()
    with torch.no_grad():
        ep = torch.export.export(model, (torch.randn(4, 64, device=device),))
        Path(workdir).mkdir(parents=True, exist_ok=True)
        path = Path(torch._inductor.aoti_compile_and_package(ep,
                                                             package_path=str(Path(workdir) / f"probe-{device}.pt2")))
    check_loads(path)
    return path


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m bench.probes.aoti",
                                 description="Can this torch load an AOTInductor package?")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    ap.add_argument("--workdir", type=Path, default=Path("build/aoti"))
    a = ap.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: this torch sees no CUDA GPU (--device cpu probes the CPU)")
    t0 = time.perf_counter()
    try:
        path = probe(a.workdir, a.device)
    except RuntimeError as e:
        print(f"AOTInductor on {a.device} (torch {torch.__version__}): {e}", file=sys.stderr, flush=True)
        return 1
    print(f"AOTInductor on {a.device} (torch {torch.__version__}): {path.name} built and loaded in a fresh process "
          f"({time.perf_counter() - t0:.1f} s)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
