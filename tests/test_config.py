"""The values of chattts_triton/config.py that mirror upstream ChatTTS 0.2.5, against upstream's own objects: the
architecture (`ChatTTS.config.Config`), the audio framing (its Vocos config), the speaker statistics, the sampling
defaults (`Chat.RefineTextParams`, `Chat.InferCodeParams`) and the logits processors (`ChatTTS.model.gen_logits`)."""

from __future__ import annotations

import dataclasses

import ChatTTS
import pytest
from ChatTTS.config import Config
from ChatTTS.model import gen_logits

from chattts_triton import config as C
from chattts_triton.model.spk_stat import SPK_STAT


def test_the_full_architecture_is_upstreams():
    up, a = Config(), C.FULL_ARCH
    gpt = up.gpt
    assert (a.gpt.hidden, a.gpt.intermediate, a.gpt.heads, a.gpt.layers, a.gpt.max_positions) == (
        gpt.hidden_size, gpt.intermediate_size, gpt.num_attention_heads, gpt.num_hidden_layers,
        gpt.max_position_embeddings)
    assert (a.num_audio_tokens, a.num_text_tokens, a.num_vq) == (gpt.num_audio_tokens, gpt.num_text_tokens, gpt.num_vq)
    assert (C.NUM_AUDIO_TOKENS, C.NUM_TEXT_TOKENS, C.NUM_VQ) == (gpt.num_audio_tokens, gpt.num_text_tokens, gpt.num_vq)
    for ours, theirs in ((a.decoder, up.decoder), (a.dvae_decoder, up.dvae.decoder), (a.dvae_encoder, up.dvae.encoder)):
        assert dataclasses.asdict(ours) == dataclasses.asdict(theirs)
    vq = up.dvae.vq
    assert (a.vq_dim, a.vq_levels, a.vq_groups, a.vq_residual) == (vq.dim, tuple(vq.levels), vq.G, vq.R)
    backbone = up.vocos.backbone.init_args
    assert (a.vocos.dim, a.vocos.intermediate, a.vocos.layers) == (backbone.dim, backbone.intermediate_dim,
                                                                   backbone.num_layers)


def test_the_audio_framing_is_upstreams():
    mel, head = Config().vocos.feature_extractor.init_args, Config().vocos.head.init_args
    assert (C.SAMPLE_RATE, C.N_FFT, C.HOP_LENGTH, C.N_MELS) == (mel.sample_rate, mel.n_fft, mel.hop_length, mel.n_mels)
    assert (head.n_fft, head.hop_length) == (C.N_FFT, C.HOP_LENGTH)
    assert C.SAMPLES_PER_CODE == 512 and C.samples_for_codes(1) == C.HOP_LENGTH and C.samples_for_codes(0) == 0


def test_the_speaker_statistics_are_upstreams():
    assert SPK_STAT == Config().spk_stat


@pytest.mark.parametrize("ours,theirs", [(C.RefineTextParams, ChatTTS.Chat.RefineTextParams),
                                         (C.InferCodeParams, ChatTTS.Chat.InferCodeParams)])
def test_the_sampling_defaults_are_upstreams(ours, theirs):
    up = dataclasses.asdict(theirs())
    mine = dataclasses.asdict(ours())
    assert mine == {k: up[k] for k in mine}


def test_the_logits_processors_use_upstreams_window_and_floor():
    warpers, processors = gen_logits(C.NUM_AUDIO_TOKENS, 0.7, 20, 1.05)
    assert {w.min_tokens_to_keep for w in warpers} == {C.MIN_TOKENS_TO_KEEP}
    assert [p.past_window for p in processors] == [C.REPETITION_WINDOW]
    assert C.AUDIO_EOS == C.NUM_AUDIO_TOKENS - 1
