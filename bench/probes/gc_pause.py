"""What a full garbage collection costs a process that compiled the decode step, and what freezing saves.

    python -m bench.probes.gc_pause --assets ASSETS [--backend inductor] [--batches 1,4,8] [--out FILE]

Loads the GPT of ASSETS into an engine on this machine's CPU, compiles its decode step (`Engine.compile_step`, as a
GPU instance does, with `--backend`) and runs it for each batch size, then times `gc.collect()`: once to clear what
the compile left, once more over the survivors alone (what every later full collection scans: a stall of the whole
process, the engine's thread included), and once after `backend.freeze_start_up_objects` (what a Triton instance does
after its start-up). Prints and writes the tracked objects and each collection's ms.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch


def _collect_ms() -> float:
    t0 = time.perf_counter()
    gc.collect()
    return round(1000 * (time.perf_counter() - t0), 1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--assets", type=Path, required=True)
    ap.add_argument("--backend", default="inductor", help="torch.compile's backend (eager: dynamo alone, quick)")
    ap.add_argument("--batches", default="1,4,8", help="decode-step batch sizes run after the compile")
    ap.add_argument("--out", type=Path, help="write the figures as JSON here")
    a = ap.parse_args(argv)
    from chattts_triton.model.assets import infer_arch
    from chattts_triton.model.gpt import load_gpt
    from chattts_triton.runtime.engine import Engine
    from chattts_triton.triton.backend import freeze_start_up_objects

    batches = [int(b) for b in a.batches.split(",") if b]
    res: dict = {"assets": str(a.assets), "backend": a.backend, "batches": batches, "torch": torch.__version__,
                 "python": sys.version.split()[0]}
    gc.collect()
    res["objects_at_start"] = len(gc.get_objects())
    arch = infer_arch(a.assets, {})
    engine = Engine(load_gpt(a.assets, arch).eval(), max_slots=max(batches), max_context=512, max_new_tokens=64,
                    hidden=arch.gpt.hidden, num_vq=arch.num_vq, device="cpu", start=False)
    engine.compile_step(dynamic=True, backend=a.backend)
    t0 = time.perf_counter()
    with torch.inference_mode():
        engine._set_live(0)  # every row padding: the step's work, no count advancing
        for b in batches:
            engine.graph_step(0, b, 64, "code", engine.n_live)
    res["compile_s"] = round(time.perf_counter() - t0, 1)
    res["objects_after_compile"] = len(gc.get_objects())
    res["first_collect_ms"] = _collect_ms()  # what the compile left behind
    res["objects_alive"] = len(gc.get_objects())
    res["full_collect_ms"] = _collect_ms()  # the survivors alone: every later full collection's scan
    freeze_start_up_objects()
    res["frozen"] = gc.get_freeze_count()
    res["full_collect_frozen_ms"] = _collect_ms()
    gc.unfreeze()
    print(json.dumps(res, indent=1), flush=True)
    if a.out:
        a.out.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
