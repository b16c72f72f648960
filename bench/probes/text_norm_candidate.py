"""One text-normalisation library, measured inside its own virtual environment (run by `bench.probes.text_norm
--candidates`, with that environment's python): start-up, cost per call, and how many cases of the hand-written
tables (tests/spoken_cases.py) it reads as expected. Prints one JSON line.

usage: python bench/probes/text_norm_candidate.py NAME CASES_FILE   (NAME: wetext | wetextprocessing | nemo | cn2an)
"""

from __future__ import annotations

import importlib.util
import json
import logging
import re
import statistics
import sys
import time

ISSUE = {"zh": "我有3个苹果，价格是12.5元，增长了45%。", "en": "Meet me at 10:30 on 2026-12-02, it costs $12.50."}


def load(name: str, cache_dir: str):
    """(zh, en) callables: text -> spoken text, as each library documents its use."""
    if name == "wetext":
        from wetext import Normalizer

        return Normalizer(lang="zh", operator="tn").normalize, Normalizer(lang="en", operator="tn").normalize
    if name == "wetextprocessing":  # upstream ChatTTS's recommendation for Chinese
        from tn.chinese.normalizer import Normalizer as Zh
        from tn.english.normalizer import Normalizer as En

        return Zh().normalize, En().normalize
    if name == "nemo":  # upstream ChatTTS's recommendation for English (tools/normalizer/en.py)
        logging.disable(logging.CRITICAL)
        from nemo_text_processing.text_normalization.normalize import Normalizer

        zh = Normalizer(input_case="cased", lang="zh", cache_dir=cache_dir)
        en = Normalizer(input_case="cased", lang="en", cache_dir=cache_dir)
        return zh.normalize, lambda t: en.normalize(t, verbose=False, punct_post_process=True)
    if name == "cn2an":  # Chinese numbers, and num2words for every English number
        import cn2an
        from num2words import num2words

        def en(t: str) -> str:
            return re.sub(r"\d+(?:\.\d+)?", lambda m: num2words(float(m.group()) if "." in m.group()
                                                                else int(m.group())), t)

        return (lambda t: cn2an.transform(t, "an2cn")), en
    raise SystemExit(f"unknown candidate {name}")


def main() -> None:
    name, cases_file = sys.argv[1], sys.argv[2]
    spec = importlib.util.spec_from_file_location("spoken_cases", cases_file)
    cases = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cases)
    t0 = time.perf_counter()
    zh, en = load(name, cache_dir=sys.argv[3] if len(sys.argv) > 3 else "")
    start = time.perf_counter() - t0
    out = {"name": name, "start_s": round(start, 3)}
    for lang, fn in (("zh", zh), ("en", en)):
        fn(ISSUE[lang])
        times = []
        for _ in range(50):
            t = time.perf_counter()
            fn(ISSUE[lang])
            times.append(time.perf_counter() - t)
        out[f"{lang}_issue_p50_ms"] = round(statistics.median(times) * 1e3, 3)
        out[f"{lang}_issue_spoken"] = fn(ISSUE[lang])

    def canon(s: str) -> str:  # tests/test_spoken.same_speech
        s = re.sub(r"\bo\b", "oh", s.lower().replace("-", " ").replace(",", " "))
        return re.sub(r"\s+", " ", s).strip()

    def per_part(fn, text):  # control tokens kept out of the library, as upstream's Normalizer does
        return "".join(p if p.startswith("[") else fn(p) for p in re.split(r"(\[[^\]]*\])", text))

    for lang, fn, table in (("zh", zh, cases.ZH_CASES), ("en", en, cases.EN_CASES)):
        ok = 0
        for written, accepted in table:
            try:
                got = per_part(fn, written)
            except Exception:  # noqa: BLE001  a crash is a miss
                continue
            ok += canon(got) in {canon(a) for a in accepted}
        out[f"{lang}_table"] = f"{ok}/{len(table)}"
    print(json.dumps(out, ensure_ascii=False))


if __name__ == "__main__":
    main()
