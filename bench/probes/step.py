"""Decode-step time of the engine, per batch size, for each way of running the GPT.

    python -m bench.probes.step --assets build/assets-full --out OUT [--batches 1,8,64,256,512]
                         [--variants script,eager,compile] [--attn-len 256] [--device cpu]

No Triton: one `Engine` on one GPU, the decode step of `--attn-len` captured in a CUDA graph per
batch size exactly as the server does (`CudaGraphs`), replays timed with CUDA events (median of
`--iters`). Then the prefill of `--prefill` shapes (prompts x tokens) as the engine admits them
(embedding, GPT, first-token draw, its one host sync; wall ms, median), eagerly and from its graph. For
`script`/`eager` also times the GPT forward alone (graph of `model(...)`), so the rest of the step (embedding,
heads, sampling, bookkeeping) is the difference. Writes OUT/step-<variant>.json.
Variants: `script` = the exported TorchScript (what `chattts_gpt` serves by default), `eager` =
the same module unscripted, `compile` = the engine step compiled by torch.compile (inductor), one
compile per bucket, `compile_dynamic` = one compile with dynamic shapes for all buckets; each with
`_unfused` appended: q/k/v and gate/up as five GEMMs per layer (the model before `fuse_projections`);
`_sdpa` (eager/compile): the dense masked attention over `--attn-len` instead of each row's own keys;
`_gemv` (compile): a step of one row computes its projections and code heads as inductor's reductions, not cuBLAS
GEMMs (`--gpt-gemv`, `ChatTTSGPT.set_gemv`; more rows unchanged), its layers' projections as `rowops.row_matvec`
kernels; `_gemv_inductor`: as inductor's reductions instead; `_gemv_nopdl`: the kernels launched one after the
other, not as programmatic dependents (`rowops.PDL`); `_tune` (after either): and the launch configurations of
inductor's kernels tuned at the first run (`--gpt-gemv-tune`, runtime/tuning.py); `_fp8` (compile): the KV cache
in float8 e4m3 (`--kv-cache-dtype fp8`).
`aoti` / `aoti_traced`: the step from AOTInductor packages, one per bucket (`bench/probes/aoti.py`; the decode
attention through its custom operator, or its Triton kernel compiled into the package): the export users
would ship instead of TorchScript + torch.compile at start-up; `build_s` is a package's export + compile,
`load_s` its load (a server's start-up cost, against `capture_s` of the compile variants).
`--compile-prefill`: the compile variants' prefills run compiled too (their eager and graph figures).
`--lengths uniform`: rows at positions spread below `--attn-len` (what the decode kernel gains in serving).
`--loop-tokens N`: then, per batch size, that many requests of N forced frames through the engine's own loop
(`Engine._run_once` on this thread: admission, steps, bookkeeping, results), once to capture its graphs, then
once per `--overlap` setting (on: the host's bookkeeping of a step overlaps the next step, `Engine.overlap`):
wall ms per step against the GPU clock's ms per step (the engine's counters), the host's share of a step.
`--profile N`: also profile N steps of each batch (and N prefills of each shape) launched without a
graph (torch.profiler) and record the device kernels per step, their summed time and the most expensive kernels: where a
launch-bound step's time goes (on a CPU, the leaf operators instead of kernels).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from bench.common import profile_kernels


def _time_graph(fn, iters: int) -> float:
    """Median ms of `fn` replays (fn launches a captured graph)."""
    times = []
    for _ in range(5):
        fn()
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def _time_wall(fn, iters: int) -> float:
    """Median wall ms of `fn` (what ends in a host sync: a CPU step, a prefill)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(1000 * (time.perf_counter() - t0))
    return statistics.median(times)


def _forward(engine, b: int, attn_len: int):
    """The GPT forward of a decode step of b rows at attn_len, as a callable."""
    m = engine.model
    x = torch.randn(b, 1, engine.hidden, device=engine.device, dtype=engine.compute_dtype)
    pos = torch.full((b, 1), attn_len - 1, dtype=torch.int64, device=engine.device)
    tables = engine.block_table.narrow(0, 0, b)  # free slots: the scratch page, a page-bound step's reads
    return lambda: m(x, pos, tables, engine.k_cache, engine.v_cache, attn_len)


def _forward_graph(engine, b: int, attn_len: int):
    fwd = _forward(engine, b, attn_len)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fwd()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fwd()
    return g.replay


def _set_positions(engine, b: int, attn_len: int, lengths: str) -> None:
    """Rows 0..b-1 feed position attn_len-1 ("full") or uniform positions below it, the largest attn_len-1
    ("uniform": a served mix; each row attends its own keys with the decode kernel)."""
    g = torch.Generator().manual_seed(b)
    pos = torch.full((b,), attn_len - 1) if lengths == "full" else torch.randint(0, attn_len, (b,), generator=g)
    pos[0] = attn_len - 1
    rows = engine.row_params.narrow(0, b)
    rows.prompt_len.copy_(pos)
    rows.n.fill_(1)  # fed position = prompt length + n - 1
    for i in range(engine.max_slots):  # each row reads and writes pages of its own, as served
        engine._release(i)
    for i, p in enumerate(pos.tolist()):
        engine._grant(i, p // engine.page + 1)
    engine._sync_tables()


def _loop(engine, b: int, tokens: int, overlap: bool) -> dict:
    """b requests of `tokens` forced frames (prompts of 16 tokens) through the engine's loop on this thread: per
    step, wall ms and the GPU clock's ms (sampled every GPU_TIMING_EVERY-th step), from the engine's counters."""
    import dataclasses

    from chattts_triton.runtime.engine import GenRequest, SamplingParams

    for i in range(engine.max_slots):  # whatever the step timings left: every slot free, every page back
        engine._release(i)
    engine._clear_free(0, engine.max_slots)
    engine._sync_tables()
    engine.overlap = overlap
    g = torch.Generator().manual_seed(b)
    done: list = []
    for i in range(b):
        engine.submit(GenRequest(torch.randint(0, 21000, (16,), generator=g),
                                 SamplingParams(1.0, None, None, 1.0, tokens, tokens, seed=i), done.append,
                                 want_hidden=False))
    c0 = dataclasses.replace(engine.counters)
    t0 = time.perf_counter()
    while len(done) < b:
        engine._run_once(block=False)
    wall = time.perf_counter() - t0
    c = engine.counters
    steps, gpu_n = c.steps - c0.steps, c.step_gpu_samples - c0.step_gpu_samples

    def per_step(field: str, n: int):
        return round(1000 * (getattr(c, field) - getattr(c0, field)) / n, 4) if n else None

    return {"overlap": overlap, "steps": steps, "wall_ms_per_step": per_step("step_seconds", steps),
            "device_ms_per_step": per_step("step_device_seconds", steps),
            "gpu_ms_per_step": per_step("step_gpu_seconds", gpu_n),
            "gpu_samples": gpu_n, "prefill_ms": per_step("prefill_seconds", c.prefills - c0.prefills),
            "total_s": round(wall, 3)}


def prefill_once(engine, k: int, t: int, graphed: bool):
    """A callable admitting k prompts of t tokens into an idle engine (`Engine._prefill`), reading their first
    tokens back (the draw's host sync; with the engine's overlap, CUDA's default, `_land_first` reads them, as the
    next decode step would), then freeing their slots."""
    from chattts_triton.runtime.engine import GenRequest, SamplingParams

    g = torch.Generator().manual_seed(k * 1000 + t)
    reqs = [GenRequest(torch.randint(0, 21000, (t,), generator=g), SamplingParams(1.0, None, None, 1.0, 8, 8, seed=i),
                       lambda r: None) for i in range(k)]

    def once() -> None:
        engine.prefill_graphs = graphed
        engine._prefill(reqs)
        engine._land_first()  # no-op without overlap: `_prefill` read them itself
        for i in range(k):
            engine._release(i)
        engine.rows.clear()
        engine._clear_free(0, k)

    return once


def _time_prefill(engine, k: int, t: int, graphed: bool, iters: int) -> float:
    """Median wall ms of admitting k prompts of t tokens into an idle engine."""
    return _time_wall(prefill_once(engine, k, t, graphed), iters)


def run_variant(variant: str, args, arch, dtype, out: dict) -> dict:  # noqa: C901  a probe's script: every variant's branches in one run, read top to bottom
    from chattts_triton.model import rowops
    from chattts_triton.model.gpt import load_gpt
    from chattts_triton.runtime.engine import PREFILL_GRAPH_TOKENS, Engine

    # "_unfused": q/k/v and gate/up as five GEMMs, as before fusing; "_sdpa": the dense masked attention
    # over the step's attention length instead of each row's own keys (`attention.decode_attention`)
    sdpa = "_sdpa" in variant
    gemv = "_gemv" in variant
    tune = "_tune" in variant  # with _gemv: the one-row compile's launch configurations tuned (--gpt-gemv-tune)
    fp8 = "_fp8" in variant  # the KV cache in float8 e4m3 (--kv-cache-dtype fp8)
    row_kernels = "_inductor" not in variant  # with _gemv: the layers' projections as rowops kernels
    rowops.PDL = "_nopdl" not in variant  # with them: launched as programmatic dependents (Hopper)
    base = (variant.replace("_sdpa", "").replace("_gemv", "").replace("_tune", "").replace("_inductor", "")
            .replace("_nopdl", "").replace("_fp8", "").removesuffix("_unfused"))
    fused = "_unfused" not in variant
    cuda = args.device == "cuda"
    compiled = base.startswith("compile")
    gemv_only = tune or not row_kernels or not rowops.PDL
    if base not in ("script", "eager", "compile", "compile_dynamic", "aoti", "aoti_traced") or (
            compiled and not cuda) or (gemv and not compiled) or (gemv_only and not gemv) or (fp8 and not compiled):
        raise SystemExit(f"unknown variant {variant}" + ("" if cuda else " on a CPU (script, eager, aoti, *_unfused)"))
    model = load_gpt(args.assets, arch, fused=fused).to(dtype).to(args.device).eval()
    if base == "script":
        model = torch.jit.script(model)
    slots = max(args.batches + [int(shape.split("x")[0]) for shape in args.prefill])
    engine = Engine(model, max_slots=slots, max_context=args.context, max_new_tokens=args.max_new_tokens,
                    hidden=arch.gpt.hidden, num_vq=arch.num_vq, device=args.device,
                    cache_dtype=torch.float8_e4m3fn if fp8 else dtype,
                    compute_dtype=dtype, start=False, decode_kernel=False if sdpa or base == "script" else None)
    if base.startswith("compile"):
        engine.compile_step(dynamic=base == "compile_dynamic", prefill=args.compile_prefill, gemv=gemv,
                            gemv_tune=tune, gemv_kernels=gemv and row_kernels)
    aoti = None
    if base.startswith("aoti"):  # the step from AOTInductor packages, one per bucket (bench/probes/aoti.py)
        from bench.probes.aoti import AotiStep

        aoti = engine.graph_step = AotiStep(engine, args.aoti_dir, kernel="traced" if base == "aoti_traced" else "op")

    def aoti_times(b: int) -> dict:
        if aoti is None:
            return {}
        key = (b, args.attn_len)
        return {"build_s": round(aoti.build_s[key], 2), "load_s": round(aoti.load_s[key], 3)}
    out.update({"variant": variant, "attn_len": args.attn_len, "lengths": args.lengths, "dtype": str(dtype),
                "compiled_prefill": engine.graph_prefill is not None,
                "decode_kernel": engine.decode_kernel, "batches": {}})
    for b in args.batches:
        _set_positions(engine, b, args.attn_len, args.lengths)
        if not cuda:  # the step as the CPU engine runs it: eager, every row padding
            step = engine.compiled_step(b) or engine.step_core  # aoti: its package
            with torch.inference_mode():
                engine._set_live(0)
                step_ms = _time_wall(lambda step=step, b=b: step(0, b, args.attn_len, "code", engine.n_live),
                                     args.iters)
                fwd_ms = _time_wall(_forward(engine, b, args.attn_len), args.iters)
            row = {"step_ms": round(step_ms, 3), "forward_ms": round(fwd_ms, 3), "rest_ms": round(step_ms - fwd_ms, 3)}
            row.update(aoti_times(b))
            if args.profile:
                with torch.inference_mode():
                    row["profile"] = profile_kernels(
                        lambda step=step, b=b: step(0, b, args.attn_len, "code", engine.n_live), args.profile, cuda)
            out["batches"][b] = row
            print(f"[{variant}] batch {b:4d}: {row}", flush=True)
            continue
        if aoti is not None:  # built and loaded before the capture, on the default stream
            with torch.no_grad():
                aoti.runner(b, args.attn_len)
        t0 = time.perf_counter()
        with torch.no_grad():
            run = engine.graphs.decode_graph("code", b, args.attn_len)
            engine._set_live(0)  # every row padding: same work, but no count advances past the cache
            torch.cuda.synchronize()
            capture_s = time.perf_counter() - t0
            step_ms = _time_graph(run, args.iters)
            row = {"step_ms": round(step_ms, 4), "capture_s": round(capture_s, 2)}
            row.update(aoti_times(b))  # capture_s: the warm-up and capture alone (the package is built and loaded)
            if base in ("script", "eager"):  # the compiled and packaged steps have no separate forward to time
                fwd_ms = _time_graph(_forward_graph(engine, b, args.attn_len), args.iters)
                row.update(forward_ms=round(fwd_ms, 4), rest_ms=round(step_ms - fwd_ms, 4))
            if args.profile:  # the step's own launches, without the graph (the same kernels)
                step = engine.compiled_step(b) or engine.step_core  # compiled variants: inductor's kernels
                row["profile"] = profile_kernels(
                    lambda step=step, b=b: step(0, b, args.attn_len, "code", engine.n_live), args.profile, cuda)
        out["batches"][b] = row
        print(f"[{variant}] batch {b:4d}: {row}", flush=True)
    out["prefill"] = {}
    with torch.inference_mode():
        for shape in args.prefill:
            k, t = (int(v) for v in shape.split("x"))
            row = {"eager_ms": round(_time_prefill(engine, k, t, False, max(3, args.iters // 4)), 3)}
            if cuda:  # a shape over PREFILL_GRAPH_TOKENS has no graph: it runs eagerly either way
                kb, tb = engine.graphs.prefill_buckets(k, t)
                row["graph_ms"] = (round(_time_prefill(engine, k, t, True, max(3, args.iters // 4)), 3)
                                   if kb * tb <= PREFILL_GRAPH_TOKENS else None)
            if args.profile:  # its kernels, launched eagerly (the graph replays the same ones)
                row["profile"] = profile_kernels(prefill_once(engine, k, t, False), args.profile, cuda)
            out["prefill"][shape] = row
            print(f"[{variant}] prefill {k} prompts x {t} tokens: {row}", flush=True)
    if args.loop_tokens:
        out["loop"] = {}
        with torch.inference_mode():
            for b in args.batches:
                _loop(engine, b, args.loop_tokens, False)  # captures the graphs the loop reaches
                rows = [_loop(engine, b, args.loop_tokens, ov == "on") for ov in args.overlap]
                out["loop"][b] = rows
                for row in rows:
                    print(f"[{variant}] loop of {b} x {args.loop_tokens} frames: {row}", flush=True)
    if cuda:
        out["gpu_mem_gb"] = round(torch.cuda.max_memory_allocated() / 1e9, 2)
        # also what the allocator does not see (an AOTInductor package's weights)
        free, total = torch.cuda.mem_get_info()
        out["gpu_used_gb"] = round((total - free) / 1e9, 2)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--assets", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--batches", default="1,8,64,256,512")
    ap.add_argument("--variants", default="script,eager,compile")
    ap.add_argument("--attn-len", type=int, default=256)
    ap.add_argument("--lengths", default="full", choices=["full", "uniform"],
                    help="rows' positions: all at attn-len - 1, or uniform below it (a served mix)")
    ap.add_argument("--prefill", default="1x32,8x32,32x64", help="prefill shapes PROMPTSxTOKENS (empty: none)")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="also profile N ungraphed steps per batch (and N eager prefills per shape): kernels per "
                         "step, their time, the top ones")
    ap.add_argument("--compile-prefill", action="store_true",
                    help="compile variants: the prefills through torch.compile too (Engine.compile_step(prefill=True))")
    ap.add_argument("--loop-tokens", type=int, default=0, metavar="N",
                    help="also run each batch size's requests of N forced frames through the engine's loop (0: not)")
    ap.add_argument("--overlap", default="off,on",
                    help="with --loop-tokens: the engine's overlap settings to run, comma list of off/on")
    ap.add_argument("--aoti-dir", type=Path, default=Path("build/aoti"),
                    help="where the aoti variants write their packages (each holds the GPT's weights: not --out)")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                    help="cpu: the eager step and prefill as the CPU engine runs them (script/eager variants)")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench.probes.step needs a CUDA GPU, or --device cpu", file=sys.stderr)
        return 2
    from chattts_triton.model.assets import infer_arch

    args.batches = [int(b) for b in args.batches.split(",")]
    args.overlap = [v.strip() for v in args.overlap.split(",") if v.strip()]
    if set(args.overlap) - {"on", "off"}:
        ap.error("--overlap must be a comma list of off and on")
    args.prefill = [p for p in args.prefill.split(",") if p]
    arch = infer_arch(args.assets, {})
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    args.out.mkdir(parents=True, exist_ok=True)
    failed = 0
    for v in args.variants.split(","):
        res: dict = {"variant": v}  # filled as it goes: what a variant measured before it failed is kept
        try:
            run_variant(v, args, arch, dtype, res)
        except Exception as e:  # noqa: BLE001  one variant that cannot run (say, no compiler for AOTInductor) spoils no other
            log_exc = f"{type(e).__name__}: {e}"
            print(f"[{v}] failed: {log_exc}", file=sys.stderr, flush=True)
            res["error"], failed = log_exc[:2000], failed + 1
        res.update(gpu=torch.cuda.get_device_name() if args.device == "cuda" else "cpu", torch=torch.__version__,
                   command=" ".join(sys.argv))
        (args.out / f"step-{v}.json").write_text(json.dumps(res, indent=1))
        if args.device == "cuda":
            torch.cuda.empty_cache()
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
