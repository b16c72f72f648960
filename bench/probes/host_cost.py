"""The engine thread's host work per admission and per finish, on this machine's CPU.

    python -m bench.probes.host_cost --assets ASSETS [--prompts 28,80] [--repeats 200] [--out FILE]

An engine on the CPU (the weights of ASSETS, decode kernel and packed prefills as a GPU runs them):
- `_packed_batch` of N corpus-like prompts (6–116 positions, a speaker embedding each): its median wall time, and the
  same with the embedding calls replaced by a constant (its host part alone: index arithmetic, copies' setup);
- `_finish_rows` while N requests finish at one step: the median wall time per result and the aten calls of one
  call (each a dispatch on the engine's thread; on a GPU host each device copy costs more than here).
On a GPU these run on the engine's thread between the steps it overlaps: where the host takes longer than a step,
the GPU waits (`engine_load --timeline`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch


def _aten_calls(fn) -> int:
    """Top-level aten calls `fn` makes (nested ones counted in their caller)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as p:
        fn()
    top, end = 0, -1
    for e in sorted((e for e in p.events() if e.name.startswith("aten::")), key=lambda e: e.time_range.start):
        if e.time_range.start >= end:
            top, end = top + 1, e.time_range.end
    return top


def measure(assets: Path, prompts: list[int], repeats: int) -> list[dict]:
    from chattts_triton.model.assets import infer_arch
    from chattts_triton.model.gpt import load_gpt
    from chattts_triton.runtime.engine import Engine, GenRequest, SamplingParams

    torch.set_grad_enabled(False)
    arch = infer_arch(assets)
    eng = Engine(load_gpt(assets, arch), hidden=arch.gpt.hidden, num_vq=arch.num_vq, max_slots=max(prompts),
                 max_context=256, max_new_tokens=8, decode_kernel=True, packed_prefill=True, start=False)
    g = torch.Generator().manual_seed(0)

    def requests(k: int, spk_dim: int) -> list:
        out = []
        for i in range(k):
            ids = torch.randint(0, arch.num_text_tokens - 100, (int(torch.randint(6, 117, (1,), generator=g)),),
                                generator=g)
            ids[1] = 21143
            out.append(GenRequest(ids, SamplingParams(0.3, 0.7, 20, 1.05, 4, 4, seed=i), lambda r: None,
                                  spk_emb=torch.randn(spk_dim, generator=g), spk_emb_id=21143))
        return out

    def median_ms(fn) -> float:
        ts = []
        for _ in range(repeats):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
        return 1000 * statistics.median(ts)

    rows = []
    for k in prompts:
        reqs = requests(k, arch.gpt.hidden)
        tokens = sum(r.prompt_len for r in reqs)
        row = {"prompts": k, "positions": tokens,
               "packed_batch_aten_calls": _aten_calls(lambda reqs=reqs, t=tokens: eng._packed_batch(reqs, t, 0)),
               "packed_batch_ms": median_ms(lambda reqs=reqs, t=tokens: eng._packed_batch(reqs, t, 0))}
        model, dtype = eng.model, eng.compute_dtype
        try:  # the host part alone: embeddings of nothing, a speaker table of 4 columns
            eng.model = type("Embeds", (), {"embed_text": staticmethod(lambda t: torch.zeros(t.shape[0], 4)),
                                            "embed_code": staticmethod(lambda t: torch.zeros(t.shape[0], 4))})()
            eng.compute_dtype = torch.float32
            small = requests(k, 4)
            n_small = sum(r.prompt_len for r in small)
            row["packed_batch_host_ms"] = median_ms(lambda s=small, t=n_small: eng._packed_batch(s, t, 0))
        finally:
            eng.model, eng.compute_dtype = model, dtype
        finish = eng._finish_rows
        per, calls = [], []
        for it in range(max(3, repeats // 50)):
            for r in requests(k, arch.gpt.hidden):
                eng.submit(r)

            def timed(items, first=it == 0, calls=calls, per=per, finish=finish):
                if first and not calls:
                    calls.append(_aten_calls(lambda: finish(items)))
                    return
                t = time.perf_counter()
                finish(items)
                per.append((time.perf_counter() - t) / len(items))

            eng._finish_rows = timed
            try:
                while eng.rows or eng.scheduler.pending:
                    eng._run_once(block=False)
            finally:
                eng._finish_rows = finish
        row.update(finish_aten_calls_first_call=calls[0] if calls else None,
                   finish_us_per_result=1e6 * statistics.median(per) if per else None)
        rows.append(row)
        print(f"[host_cost] {k} prompts ({tokens} positions): _packed_batch {row['packed_batch_ms']:.2f} ms "
              f"({row['packed_batch_aten_calls']} aten calls), host part {row['packed_batch_host_ms']:.3f} ms; "
              f"_finish_rows {row['finish_us_per_result'] or 0:.1f} us a result "
              f"({row['finish_aten_calls_first_call']} aten calls in its first call)", flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.probes.host_cost", description=__doc__.split("\n\n")[0])
    ap.add_argument("--assets", type=Path, required=True)
    ap.add_argument("--prompts", default="28,80", help="comma list: prompts per admission (and rows finishing)")
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    try:
        prompts = [int(p) for p in a.prompts.split(",") if p.strip()]
    except ValueError:
        ap.error("--prompts must be a comma list of whole numbers")
    if not prompts or min(prompts) < 1:
        ap.error("--prompts must be ≥ 1")
    if a.repeats < 1:
        ap.error("--repeats must be ≥ 1")
    rows = measure(a.assets, prompts, a.repeats)
    if a.out:
        a.out.write_text(json.dumps({"torch": torch.__version__, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
