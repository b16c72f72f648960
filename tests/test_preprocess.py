"""PreprocessService (chattts_triton.runtime.preprocess): the text it hands the GPT, SPOKEN_TEXT, and what normalisation
removed (counted, logged, named when nothing is left)."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from chattts_triton.config import TINY_ARCH
from chattts_triton.model.text import InputError, TextTokenizer
from chattts_triton.runtime.preprocess import PreprocessService


@pytest.fixture(scope="module")
def pre(tiny_assets, tmp_path_factory):
    version = tmp_path_factory.mktemp("preprocess")
    (version / "tokenizer").symlink_to(Path(tiny_assets) / "tokenizer", target_is_directory=True)
    service = PreprocessService(version, TINY_ARCH, torch.device("cpu"), "torchscript")
    yield service
    service.close()


def inputs(**values):
    return {k: np.array([[v.encode() if isinstance(v, str) else v]], dtype=object if isinstance(v, str) else None)
            for k, v in values.items()}


def spoken(out) -> str:
    assert out["SPOKEN_TEXT"].shape == (1, 1) and out["SPOKEN_TEXT"].dtype == object
    return out["SPOKEN_TEXT"][0, 0].decode("utf-8")


def test_spoken_text_is_what_the_gpt_reads(pre):
    out = pre.prepare(inputs(TEXT="我有3个苹果，价格是12.5元，增长了45%。"))
    assert spoken(out) == "我有三个苹果，价格是十二点五元，增长了百分之四十五。"
    # the prompt tokens are exactly this text's, decorated as upstream decorates it
    expected = pre.tokenizer.encode("[Stts][empty_spk][speed_5]"
                                    "我有三个苹果，价格是十二点五元，增长了百分之四十五。[Ptts]")
    assert out["TEXT_IDS"][0].tolist() == expected


def test_without_normalisation_the_text_is_read_as_sent(pre):
    out = pre.prepare(inputs(TEXT="Meet me at 10:30.", NORMALIZE_TEXT=False))
    assert spoken(out) == "Meet me at 10:30."


def test_refined_text_is_the_spoken_text(tiny_assets, tmp_path):
    (tmp_path / "tokenizer").symlink_to(Path(tiny_assets) / "tokenizer", target_is_directory=True)
    tok = TextTokenizer(tmp_path / "tokenizer")
    seen = []

    def refine(ids, params):
        seen.append(tok.decode(ids))
        return np.asarray(tok.encode("refined words"), np.int64)

    service = PreprocessService(tmp_path, TINY_ARCH, torch.device("cpu"), "torchscript", refine=refine)
    try:
        out = service.prepare(inputs(TEXT="I have 3 apples.", REFINE_TEXT=True))
    finally:
        service.close()
    assert "three" in seen[0]  # refine-text reads the normalised text
    assert spoken(out) == tok.decode(tok.encode("refined words"))


def test_removed_characters_are_counted_and_logged(pre, caplog):
    before = pre.stats()
    with caplog.at_level(logging.DEBUG, logger="chattts_triton.runtime.preprocess"):
        out = pre.prepare(inputs(TEXT="你好😀😀，世界#"))
    assert spoken(out) == "你好，世界"
    after = pre.stats()
    assert after["text_normalized"] == before["text_normalized"] + 1
    assert after["text_with_removed_chars"] == before["text_with_removed_chars"] + 1
    assert after["text_removed_chars"] == before["text_removed_chars"] + 3
    assert "removed 3 character(s)" in caplog.text and "U+1F600" in caplog.text and "×2" in caplog.text
    pre.prepare(inputs(TEXT="你好，世界。"))
    assert pre.stats()["text_with_removed_chars"] == after["text_with_removed_chars"]


def test_a_text_removed_entirely_is_refused_naming_what_was_removed(pre):
    with pytest.raises(InputError, match=r"TEXT has nothing left to speak.*'😀' U\+1F600 \(GRINNING FACE\) ×2"):
        pre.prepare(inputs(TEXT="😀😀"))
    with pytest.raises(InputError, match="only control tokens"):
        pre.prepare(inputs(TEXT="[uv_break]"))
    # a number alone is no longer removed entirely: it is spoken
    assert spoken(pre.prepare(inputs(TEXT="2026"))) == "two thousand and twenty six"


# --- GPTService -----------------------------------------------------------------------------------
def test_a_gpt_pt_exported_before_the_paged_cache_is_served_through_the_eager_module(tiny_assets, tmp_path, caplog):
    """A repository exported before the paged KV cache holds a gpt.pt whose forward takes a slot range: the
    service warns, builds the eager module from its weights and generates what the current export does."""
    from chattts_triton.model.gpt import ChatTTSGPT, load_gpt
    from chattts_triton.runtime.gpt import GPTService

    class BeforePages(ChatTTSGPT):
        def forward(self, x: torch.Tensor, positions: torch.Tensor, slot_start: int, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, attn_len: int) -> torch.Tensor:
            raise RuntimeError("the slot-range interface")

    current = load_gpt(tiny_assets, TINY_ARCH)
    old = BeforePages(TINY_ARCH)
    old.fuse_projections()
    old.load_state_dict(current.state_dict())
    torch.jit.script(old).save(str(tmp_path / "old.pt"))
    torch.jit.script(current).save(str(tmp_path / "new.pt"))
    kw = dict(arch=TINY_ARCH, device=torch.device("cpu"), dtype="fp32", max_slots=2, max_context=256, max_new_tokens=64,
              text_eos_id=0, spk_emb_id=1)
    request = {"TEXT_IDS": np.arange(5, 25).reshape(1, -1), "SEED": np.array([[3]]),
               "MAX_NEW_TOKENS": np.array([[12]], np.int32), "MIN_NEW_TOKENS": np.array([[12]], np.int32)}
    outs = []
    for name in ("new.pt", "old.pt"):
        with caplog.at_level(logging.WARNING, logger="chattts_triton"):
            svc = GPTService(tmp_path / name, **kw)
        try:
            assert isinstance(svc.engine.model, torch.jit.ScriptModule) == (name == "new.pt")
            outs.append(svc.call(request, timeout=120))
        finally:
            svc.close()
    assert "exported before the paged KV cache" in caplog.text
    assert np.array_equal(outs[0]["CODES"], outs[1]["CODES"]) and outs[0]["CODES"].shape == (1, 12, 4)
    assert np.allclose(outs[0]["HIDDENS"], outs[1]["HIDDENS"], atol=1e-4)
