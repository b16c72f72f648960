"""What the spoken-form step costs a request (docs/text-normalization.md), and how the candidate libraries compare.

    python -m bench.probes.text_norm [--reps 200] [--out FILE.json]
        start-up of the grammars (a fresh process), then per text of the corpus (the issue's two sentences, every
        input of the hand-written tables, plain sentences without digits) the server's Normalizer with and without
        the spoken-form step, one text at a time (concurrency 1); prints the added cost's p50 / p90 / max and the
        issue sentences' own.
    python -m bench.probes.text_norm --candidates DIR [--only wetext,cn2an]
        one fresh virtual environment per candidate library under DIR (pip install from the package index):
        install time and size, start-up, cost per call on the issue sentences, cases of the tables read as expected.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CASES = ROOT / "tests" / "spoken_cases.py"
ISSUE = ["我有3个苹果，价格是12.5元，增长了45%。", "Meet me at 10:30 on 2026-12-02, it costs $12.50."]
PLAIN = ["四川美食确实以辣闻名，但也有不辣的选择。", "The weather is nice today, let us go for a walk in the park.",
         "Chat T T S 是一款强大的对话式文本转语音模型。[uv_break]它有中英混读和多说话人的能力。[laugh_0]"]
# name -> pip requirements of its environment
CANDIDATES = {
    "wetext": ["wetext==0.1.8"],
    "wetextprocessing": ["wetextprocessing==1.2.0"],
    "nemo": ["nemo-text-processing==1.2.0"],
    "cn2an": ["cn2an==0.5.24", "num2words==0.5.14"],
}


def _median(xs: list[float]) -> float:
    return statistics.median(xs)


def _quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def start_up() -> dict[str, float]:
    """Seconds to import and load the grammars and serve a first text, in a fresh interpreter."""
    code = ("import time; t=time.perf_counter(); from chattts_triton.model.spoken import default; s=default(); "
            "t1=time.perf_counter(); s('我有3个苹果', 'zh'); s('at 10:30', 'en'); t2=time.perf_counter(); "
            "print(t1-t, t2-t1)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    load, first = map(float, out.stdout.split())
    return {"load_s": round(load, 3), "first_texts_s": round(first, 4)}


def per_request(reps: int) -> dict:
    sys.path.insert(0, str(ROOT))
    from chattts_triton.model.spoken import default
    from chattts_triton.model.text import Normalizer
    from tests.spoken_cases import EN_CASES, ZH_CASES

    plain, served = Normalizer(), Normalizer(spoken=default())
    corpus = ISSUE + [w for w, _ in ZH_CASES + EN_CASES] + PLAIN
    added, rows = [], {}
    for text in corpus:
        served(text), plain(text)
        with_, without = [], []
        for _ in range(reps):  # interleaved: both see the same load on a shared machine
            t = time.perf_counter()
            served(text)
            with_.append(time.perf_counter() - t)
            t = time.perf_counter()
            plain(text)
            without.append(time.perf_counter() - t)
        cost = (_median(with_) - _median(without)) * 1e3
        added.append(cost)
        rows[text] = {"with_ms": round(_median(with_) * 1e3, 4), "without_ms": round(_median(without) * 1e3, 4),
                      "added_ms": round(cost, 4)}
    return {"texts": len(corpus), "reps": reps, "added_p50_ms": round(_median(added), 4),
            "added_p90_ms": round(_quantile(added, 0.9), 4), "added_max_ms": round(max(added), 4),
            "issue": {t: rows[t] for t in ISSUE}, "per_text": rows}


def candidates(work: Path, only: list[str]) -> list[dict]:
    rows = []
    for name in only:
        env = work / f"venv-{name}"
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(env)], check=True)
        py = str(env / "bin" / "python")
        subprocess.run([py, "-m", "pip", "install", "-q", "--upgrade", "pip"], check=True)
        site = Path(subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                   capture_output=True, text=True, check=True).stdout.strip())
        before = _size(site)
        t = time.perf_counter()
        subprocess.run([py, "-m", "pip", "install", "-q", "--no-cache-dir", *CANDIDATES[name]], check=True)
        row = {"install_s": round(time.perf_counter() - t, 1), "installed_MiB": round((_size(site) - before) / 2**20)}
        cache = work / f"cache-{name}"
        cache.mkdir(exist_ok=True)
        for run in ("first", "second"):  # NeMo compiles its grammars on the first start (cached after)
            out = subprocess.run([py, str(ROOT / "bench" / "probes" / "text_norm_candidate.py"), name, str(CASES),
                                  str(cache)],
                                 capture_output=True, text=True, check=True)
            result = json.loads(out.stdout.strip().splitlines()[-1])
            row[f"{run}_start_s"] = result.pop("start_s")
        row.update(result)
        rows.append(row)
        print(json.dumps(row, ensure_ascii=False), flush=True)
    return rows


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.probes.text_norm", description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--candidates", type=Path, metavar="DIR", help="compare the candidate libraries in venvs under DIR")
    ap.add_argument("--only", default=",".join(CANDIDATES), help="with --candidates: which (comma-separated)")
    ap.add_argument("--out", type=Path, help="also write the results as JSON here")
    a = ap.parse_args(argv)
    if a.candidates:
        a.candidates.mkdir(parents=True, exist_ok=True)
        result = {"candidates": candidates(a.candidates, [n for n in a.only.split(",") if n])}
    else:
        result = {"start_up": start_up(), **per_request(a.reps), "cpu": os.uname().machine, "cores": os.cpu_count()}
        print(f"start-up: grammars loaded in {result['start_up']['load_s']} s, first two texts "
              f"{result['start_up']['first_texts_s']} s")
        print(f"added per request over {result['texts']} texts, concurrency 1: p50 {result['added_p50_ms']} ms, "
              f"p90 {result['added_p90_ms']} ms, max {result['added_max_ms']} ms")
        for text, row in result["issue"].items():
            print(f"  {text}: +{row['added_ms']} ms ({row['without_ms']} -> {row['with_ms']} ms)")
    if a.out:
        a.out.write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
