"""Merge `bench.run` result files of one benchmark split over several device calls.

    python -m bench.combine OUT_STEM IN.json [IN.json ...]

Later files win per key (served, stream, hold, upstream_eager, upstream_compile); writes
OUT_STEM.json, .md and .png with `bench.run`'s table and plot. `sources` lists the inputs.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from bench.run import plot, to_markdown


def combine(out_stem: Path, inputs) -> dict:
    res: dict = {"sources": []}
    for p in map(Path, inputs):
        part = json.loads(p.read_text())
        res["sources"].append({"file": p.name, "command": part.get("command", "")})
        res.update({k: v for k, v in part.items() if k not in ("command", "sources") and v not in (None, [], {})})
    out_stem = Path(out_stem)
    out_stem.with_suffix(".json").write_text(json.dumps(res, indent=2))
    out_stem.with_suffix(".md").write_text(to_markdown(res))
    plot(res, out_stem.with_suffix(".png"))
    return res


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    combine(Path(sys.argv[1]), sys.argv[2:])
