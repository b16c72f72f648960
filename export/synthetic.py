"""Write a ChatTTS asset folder with random weights of the exact upstream architecture.

    python -m export.synthetic OUT [--seed N] [--size full|tiny]

The folder has the upstream layout (`Vocos.safetensors`, `DVAE.safetensors`, `Decoder.safetensors`,
`Embed.safetensors`, `gpt/`, `tokenizer/`) and is built from upstream's own module classes, so
`ChatTTS.Chat()._load(...)` accepts the full-size folder unchanged. The audio it makes is noise:
it exists so that export, serving and parity can be tested without downloading real weights.
This is a development tool: it needs the `chattts` package, serving does not.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

from chattts_triton.config import ARCHS, SPECIAL_TOKENS, Arch

_BASE_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
_CJK_PUNCT = list("，。、！？；：“”‘’（）《》【】「」『』…—～·")
_EN_WORDS = (
    "the of and to in is you that it he was for on are as with his they at be this have from or "
    "one had by word but not what all were we when your can said there use an each which she do how "
    "their if will up other about out many then them these so some her would make like him into time "
    "has look two more write go see number no way could people my than first water been call who oil "
    "its now find long down day did get come made may part hello world today weather good morning "
    "speech text voice model server triton chat audio sound test please thank thanks yes"
).split()


def build_vocab(size: int) -> list[str]:
    """A BERT-style vocab of exactly `size` tokens that tokenizes Chinese and English text."""
    ascii_chars = [chr(c) for c in range(33, 127) if chr(c) not in "[]"] + ["[", "]"]
    head = _BASE_TOKENS + ascii_chars + _CJK_PUNCT
    pieces = [f"##{c}" for c in "abcdefghijklmnopqrstuvwxyz0123456789"]
    words = [w for w in dict.fromkeys(_EN_WORDS) if len(w) > 1]
    fixed = head + pieces + words
    n_cjk = size - len(fixed) - len(SPECIAL_TOKENS)
    if n_cjk <= 0:
        raise ValueError(f"vocab size {size} too small")
    cjk = [chr(0x4E00 + i) for i in range(n_cjk)]
    vocab = fixed + cjk + list(SPECIAL_TOKENS)
    assert len(vocab) == size and len(set(vocab)) == size
    return vocab


def write_tokenizer(out: Path, size: int) -> None:
    from transformers import BertTokenizerFast

    vocab = {t: i for i, t in enumerate(build_vocab(size))}
    tok = BertTokenizerFast(vocab=vocab, do_lower_case=True, tokenize_chinese_chars=True)
    tok.add_special_tokens({"additional_special_tokens": list(SPECIAL_TOKENS)})
    if len(tok) != size:
        raise RuntimeError(f"tokenizer has {len(tok)} tokens, expected {size}")
    tok.save_pretrained(str(out))


def _save(module, path: Path) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in module.state_dict().items()}, str(path))


def write_assets(out: Path, seed: int = 0, size: str = "full", progress=print) -> Path:
    import torch
    from ChatTTS.config import Config
    from ChatTTS.model import DVAE, Embed
    from transformers import LlamaConfig, LlamaModel
    from vocos import Vocos
    from vocos.pretrained import instantiate_class

    arch: Arch = ARCHS[size]
    cfg = Config()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    os.chmod(tmp, 0o755)
    try:
        torch.manual_seed(seed)

        progress(f"[synthetic] Vocos ({size})")
        fe = asdict(cfg.vocos.feature_extractor)
        bb = asdict(cfg.vocos.backbone)
        bb["init_args"].update(dim=arch.vocos.dim, intermediate_dim=arch.vocos.intermediate,
                               num_layers=arch.vocos.layers)
        hd = asdict(cfg.vocos.head)
        hd["init_args"].update(dim=arch.vocos.dim)
        vocos = Vocos(
            feature_extractor=instantiate_class(args=(), init=fe),
            backbone=instantiate_class(args=(), init=bb),
            head=instantiate_class(args=(), init=hd),
        )
        _save(vocos, tmp / "Vocos.safetensors")

        progress("[synthetic] DVAE")
        vq = dict(dim=arch.vq_dim, levels=arch.vq_levels, G=arch.vq_groups, R=arch.vq_residual)
        dvae = DVAE(
            decoder_config=asdict(arch.dvae_decoder),
            encoder_config=asdict(arch.dvae_encoder),
            vq_config=vq,
            dim=arch.dvae_decoder.idim,
        )
        _save(dvae, tmp / "DVAE.safetensors")

        progress("[synthetic] Decoder")
        decoder = DVAE(decoder_config=asdict(arch.decoder), dim=arch.decoder.idim)
        _save(decoder, tmp / "Decoder.safetensors")

        progress("[synthetic] Embed")
        embed = Embed(arch.gpt.hidden, arch.num_audio_tokens, arch.num_text_tokens, arch.num_vq)
        _save(embed, tmp / "Embed.safetensors")

        progress("[synthetic] GPT (Llama)")
        g = arch.gpt
        gpt_cfg = dict(asdict(cfg.gpt))
        gpt_cfg.update(
            hidden_size=g.hidden,
            intermediate_size=g.intermediate,
            num_attention_heads=g.heads,
            num_key_value_heads=g.kv_heads,
            num_hidden_layers=g.layers,
            max_position_embeddings=g.max_positions,
            spk_emb_dim=min(gpt_cfg["spk_emb_dim"], g.hidden),
        )
        llama = LlamaModel(LlamaConfig(**gpt_cfg))
        llama.save_pretrained(str(tmp / "gpt"))

        progress("[synthetic] tokenizer")
        write_tokenizer(tmp / "tokenizer", arch.num_text_tokens)

        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    progress(f"[synthetic] wrote {out} (random weights: the audio is noise)")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m export.synthetic", description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--size", choices=sorted(ARCHS), default="full")
    a = ap.parse_args(argv)
    write_assets(a.out, a.seed, a.size, progress=lambda m: print(m, file=sys.stderr, flush=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
