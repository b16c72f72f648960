"""ChatTTS's audio networks in plain PyTorch, exact per item in a padded batch.

Four artifacts, each a re-implementation of an upstream ChatTTS 0.2.5 network that loads the
upstream safetensors unchanged:

- ``decoder``     upstream ``Chat.decoder``: GPT hidden states -> 100-bin mel (2 mel frames a step).
- ``dvae_decode`` upstream ``Chat.dvae`` (mode "decode"): 4 codes a step -> mel.
- ``dvae_encode`` upstream ``Chat.dvae.sample_audio``: 24 kHz waveform -> codes (speaker prompts).
- ``vocos``       upstream ``Chat.vocos.decode``: mel -> waveform, ISTFT inside the graph.

Upstream pads a batch with zeros and its convolutions then leak the padding into the valid region
(2noise/ChatTTS#813): a batched item differs from the same item run alone. Here every net takes the
valid length of each item and zeroes the padded steps before every op that mixes time (each
convolution); pointwise ops cannot leak. The ISTFT divides by a window envelope built from each
item's own frames. Each item of a batch so equals upstream run on that item alone, and every padded
output step is exactly zero, whatever the padding held (NaN included).

Everything is plain tensor ops that TorchScript (``torch.jit.script``) and ONNX (opset >= 17)
express. The (inverse) STFTs are fp32 matmuls with fixed DFT bases; framing and overlap-add are
reshapes, shifted slices and adds (n_fft = 4 hops), so on a GPU they stay exact fp32 where cuDNN
would run a conv1d / conv_transpose1d in TF32.

On a GPU (seen with torch 2.11, full widths):
- cuDNN runs the networks' own convolutions in TF32 by default: ~7e-3 error on mels of magnitude
  ~9, and a batched item then differs from the item alone by ~1e-3. With TF32 off
  (torch.backends.cudnn.allow_tf32 = False; onnxruntime CUDA provider option use_tf32=0) it is 2e-5.
- TorchScript ``dvae_encode`` hangs on CUDA from its second call while TorchScript's TensorExpr
  fuser is on (it fuses the quantizer's pointwise chain); with the fuser off it runs. Serve it with
  the fuser off (Triton PyTorch backend parameter ENABLE_TENSOR_FUSER "false"), via ONNX, or on CPU.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..config import HOP_LENGTH, MEL_FRAMES_PER_CODE, N_FFT, N_MELS, NUM_VQ, Arch, ConvNetDims, VocosDims
from .assets import AssetError, infer_arch, load_safetensors

# --- artifact contract ---------------------------------------------------------------------------
# Symbolic dims: B batch, T code steps, H GPT hidden size, F mel frames, N waveform samples.
CODEC_NAMES = ("decoder", "dvae_decode", "dvae_encode", "vocos")
# artifact -> ordered {tensor name: (numpy dtype name, shape)}
CODEC_INPUTS: dict[str, dict[str, tuple[str, tuple]]] = {
    "decoder": {"HIDDEN": ("float32", ("B", "T", "H")), "LENGTHS": ("int64", ("B",))},
    "dvae_decode": {"CODES": ("int64", ("B", "T", NUM_VQ)), "LENGTHS": ("int64", ("B",))},
    "dvae_encode": {"AUDIO": ("float32", (1, "N"))},
    "vocos": {"MEL": ("float32", ("B", N_MELS, "F")), "MEL_LENGTHS": ("int64", ("B",))},
}
CODEC_OUTPUTS: dict[str, dict[str, tuple[str, tuple]]] = {
    "decoder": {"MEL": ("float32", ("B", N_MELS, "2T"))},
    "dvae_decode": {"MEL": ("float32", ("B", N_MELS, "2T"))},
    "dvae_encode": {"CODES": ("int64", (1, "T", NUM_VQ))},  # T = encode_steps(N)
    "vocos": {"AUDIO": ("float32", ("B", "256*(F-1)"))},  # zero past 256*(MEL_LENGTHS-1)
}
# The upstream file each artifact reads.
CODEC_ASSET_FILES = {
    "decoder": "Decoder.safetensors",
    "dvae_decode": "DVAE.safetensors",
    "dvae_encode": "DVAE.safetensors",
    "vocos": "Vocos.safetensors",
}
# The mel STFT pads N_FFT//2 samples by reflection on each side: it needs more samples than that.
MIN_ENCODE_SAMPLES = N_FFT // 2 + 1
# Upstream's reference-audio mel scale (torchaudio MelSpectrogram, power 1, log clipped here).
MEL_LOG_CLIP = 1e-5
VOCOS_MAG_CLIP = 1e2  # upstream ISTFTHead clips exp(magnitude) here
# Envelope values at or under this are taken as "no frame covers this sample" (torch.istft's NOLA bound).
ENVELOPE_EPS = 1e-11
DVAE_KERNEL, DVAE_DILATION = 7, 2  # upstream DVAEDecoder ConvNeXt blocks
VOCOS_KERNEL = 7
# Framing and overlap-add use hop-sized blocks, so a frame must be whole hops.
assert N_FFT % HOP_LENGTH == 0, "n_fft must be a multiple of the hop length"


def stream_lookahead_codes(arch: Arch) -> int:
    """Code frames of context, on each side, that make a window's audio equal the whole utterance's.

    The radius of every time-mixing op at the mel rate: the decoder (conv_in 2 x k3, ConvNeXt
    dwconvs k7 dilation 2, out_conv k3; the larger of Decoder and DVAE), Vocos (embed k7, ConvNeXt
    k7) and the ISTFT (n_fft / hop / 2 frames overlap a sample on each side); one frame of margin.
    """
    convnet = max(2 + d.n_layer * DVAE_DILATION * (DVAE_KERNEL // 2) + 1 for d in (arch.decoder, arch.dvae_decoder))
    vocos = (VOCOS_KERNEL // 2) * (1 + arch.vocos.layers)
    mel = convnet + vocos + N_FFT // HOP_LENGTH // 2
    return -(-mel // MEL_FRAMES_PER_CODE) + 1


def vocos_samples(mel_frames: int) -> int:
    """Samples `vocos` gives for `mel_frames` frames (center ISTFT): 256*(F-1), 0 for F <= 1."""
    return HOP_LENGTH * max(int(mel_frames) - 1, 0)


def encode_steps(n_samples: int) -> int:
    """Code steps `dvae_encode` gives for `n_samples` samples: (N // 256 + 1) // 2.

    The centered STFT has N//256 + 1 frames; the stride-2 downsampling conv halves them (floor).
    """
    if n_samples < MIN_ENCODE_SAMPLES:
        raise ValueError(f"reference audio needs at least {MIN_ENCODE_SAMPLES} samples, got {n_samples}")
    return (n_samples // HOP_LENGTH + 1) // 2


# --- building blocks -----------------------------------------------------------------------------
def padding_mask(lengths: torch.Tensor, steps: int) -> torch.Tensor:
    """[B, 1, steps] bool, True at padded steps (index >= lengths[b])."""
    index = torch.arange(steps, device=lengths.device, dtype=lengths.dtype)
    return (index.unsqueeze(0) >= lengths.unsqueeze(1)).unsqueeze(1)


def _check_lengths(lengths: torch.Tensor, batch: int, name: str) -> None:
    if lengths.dim() != 1 or lengths.size(0) != batch:
        raise ValueError(name + " must have shape [" + str(batch) + "] (one length per batch item)")


class ConvNeXtBlock(nn.Module):
    """Upstream ConvNeXt block (ChatTTS DVAE and Vocos): dwconv, LayerNorm, MLP, layer scale."""

    def __init__(self, dim: int, intermediate: int, kernel: int, dilation: int):
        super().__init__()
        self.dwconv = nn.Conv1d(dim, dim, kernel, padding=dilation * (kernel // 2), dilation=dilation, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, intermediate)
        self.pwconv2 = nn.Linear(intermediate, dim)
        # Layer scale: upstream ChatTTS names it "weight", Vocos "gamma" (renamed on load).
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        y = self.depthwise(x.masked_fill(pad, 0.0)).transpose(1, 2)
        y = self.pwconv2(F.gelu(self.pwconv1(self.norm(y))))
        return x + (y * self.weight).transpose(1, 2)

    def depthwise(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.jit.is_scripting():  # (TorchScript does not compile this branch)
            if torch.compiler.is_compiling():
                return depthwise_as_sum(x, self.dwconv)
        return self.dwconv(x)


def depthwise_as_sum(x: torch.Tensor, conv: nn.Conv1d) -> torch.Tensor:
    """`conv(x)` for a depthwise `conv` (groups = channels, odd kernel, padding dilation × (kernel // 2)) as a sum of
    the kernel's shifted, scaled copies of x: under torch.compile one fused pass over x (with the mask before it),
    where the convolution is an opaque kernel (PyTorch's generic depthwise one on a GPU) and a pass of its own."""
    taps, dilation, padding = conv.weight.shape[-1], conv.dilation[0], conv.padding[0]
    steps = x.shape[-1]
    xp = F.pad(x, (padding, padding))
    w = conv.weight[:, 0, :].unsqueeze(-1)  # [C, taps, 1]
    y = w[:, 0] * xp[:, :, :steps]
    for k in range(1, taps):
        y = y + w[:, k] * xp[:, :, k * dilation : k * dilation + steps]
    return y if conv.bias is None else y + conv.bias.unsqueeze(-1)


class ConvNet(nn.Module):
    """Upstream ``DVAEDecoder``: conv_in (k3, GELU, k3), ConvNeXt blocks, 1x1 conv_out."""

    def __init__(self, dims: ConvNetDims):
        super().__init__()
        # ModuleList keeps upstream's Sequential key names (conv_in.0, conv_in.2).
        self.conv_in = nn.ModuleList(
            [nn.Conv1d(dims.idim, dims.bn_dim, 3, 1, 1), nn.GELU(), nn.Conv1d(dims.bn_dim, dims.hidden, 3, 1, 1)]
        )
        self.decoder_block = nn.ModuleList(
            [ConvNeXtBlock(dims.hidden, dims.hidden * 4, DVAE_KERNEL, DVAE_DILATION) for _ in range(dims.n_layer)]
        )
        self.conv_out = nn.Conv1d(dims.hidden, dims.odim, kernel_size=1, bias=False)

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        y = self.conv_in[0](x.masked_fill(pad, 0.0))
        y = self.conv_in[1](y)
        y = self.conv_in[2](y.masked_fill(pad, 0.0))
        for block in self.decoder_block:
            y = block(y, pad)
        return self.conv_out(y)  # 1x1: no time mixing


class ResidualFSQ(nn.Module):
    """One group of vector_quantize_pytorch's ResidualFSQ as ChatTTS configures it.

    Symmetry-preserving FSQ with a hard clamp after a tanh soft clamp (1 + 1/(L-1)); quantizer q
    works on residual / L**-q. Float ops mirror upstream's order so codes match bit for bit.
    """

    def __init__(self, dim: int, levels: Sequence[int], num_quantizers: int):
        super().__init__()
        n = len(levels)
        self.project_in = nn.Linear(dim, n)
        self.project_out = nn.Linear(n, dim)
        self.num_quantizers = num_quantizers
        self.codebook_size = int(math.prod(levels))
        lv = torch.tensor(list(levels), dtype=torch.int64)
        basis = torch.cumprod(torch.tensor([1] + list(levels[:-1]), dtype=torch.int64), 0)
        self.register_buffer("levels", lv, persistent=False)
        self.register_buffer("basis", basis, persistent=False)
        self.register_buffer("basis_f", basis.float(), persistent=False)
        self.register_buffer("levels_m1", (lv - 1).float(), persistent=False)
        self.register_buffer("step", 2.0 / (lv - 1).float(), persistent=False)  # code spacing 2/(L-1)
        self.register_buffer("soft_clamp", 1 + (1 / (lv - 1)), persistent=False)
        self.register_buffer(
            "scales", torch.stack([lv.float() ** -q for q in range(num_quantizers)]), persistent=False
        )  # [R, n]

    def quantize(self, x: torch.Tensor) -> torch.Tensor:
        """[..., dim] float32 -> [..., R] int64 indices."""
        x = self.project_in(x)
        x = torch.tanh(x / self.soft_clamp) * self.soft_clamp
        residual = x
        indices: list[torch.Tensor] = []
        for q in range(self.num_quantizers):
            scale = self.scales[q]
            z = torch.clamp(residual / scale, -1.0, 1.0)
            bracket = torch.floor((self.levels_m1 * (z + 1.0) / 2.0) + 0.5)
            codes = self.step * bracket - 1.0
            indices.append(torch.round(((codes + 1.0) / self.step * self.basis_f).sum(-1)).to(torch.int64))
            residual = residual - codes * scale
        return torch.stack(indices, -1)

    def embed(self, indices: torch.Tensor) -> torch.Tensor:
        """[..., R] int64 indices -> [..., dim]: sum of the R scaled codes, projected out."""
        indices = torch.clamp(indices, 0, self.codebook_size - 1)
        level = torch.remainder(torch.div(indices.unsqueeze(-1), self.basis, rounding_mode="trunc"), self.levels)
        codes = level.to(torch.float32) * self.step - 1.0  # [..., R, n]
        return self.project_out((codes * self.scales).sum(-2))


class GroupedFSQ(nn.Module):
    """Upstream ``GFSQ``: G groups of residual FSQ over equal slices of the feature dim."""

    def __init__(self, dim: int, levels: Sequence[int], groups: int, num_quantizers: int):
        super().__init__()
        self.groups = groups
        self.num_quantizers = num_quantizers
        self.rvqs = nn.ModuleList([ResidualFSQ(dim // groups, levels, num_quantizers) for _ in range(groups)])

    def quantize(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, dim] -> [B, T, G*R] indices (index g*R + r, upstream's layout)."""
        chunks = x.chunk(self.groups, -1)
        out: list[torch.Tensor] = []
        for g, rvq in enumerate(self.rvqs):
            out.append(rvq.quantize(chunks[g]))
        return torch.cat(out, -1)

    def embed(self, codes: torch.Tensor) -> torch.Tensor:
        """[B, T, G*R] indices -> [B, T, dim]."""
        r = self.num_quantizers
        out: list[torch.Tensor] = []
        for g, rvq in enumerate(self.rvqs):
            out.append(rvq.embed(codes[:, :, g * r : (g + 1) * r]))
        return torch.cat(out, -1)


# --- the artifacts -------------------------------------------------------------------------------
class MelDecoder(nn.Module):
    """``decoder``: HIDDEN [B,T,H] fp32, LENGTHS [B] int64 -> MEL [B,100,2T] fp32.

    Upstream DVAE decode path after the quantizer: [B,H,T] -> [B,H/2,2T] (the two halves of each
    step become two frames), ConvNet, out_conv (k3), times coef.
    """

    def __init__(self, dims: ConvNetDims):
        super().__init__()
        self.in_channels = 2 * dims.idim
        self.register_buffer("coef", torch.ones(1, N_MELS, 1))
        self.decoder = ConvNet(dims)
        self.out_conv = nn.Conv1d(dims.odim, N_MELS, 3, 1, 1, bias=False)

    def decode(self, feats: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """feats [B, H, T] (channels first, like upstream's input) -> mel [B, 100, 2T] fp32."""
        b, c, t = feats.size(0), feats.size(1), feats.size(2)
        x = feats.reshape(b, 2, c // 2, t).permute(0, 2, 3, 1).reshape(b, c // 2, 2 * t)
        pad = padding_mask(lengths * 2, 2 * t)
        y = self.decoder(x.to(self.out_conv.weight.dtype), pad)
        mel = self.out_conv(y.masked_fill(pad, 0.0)).float() * self.coef
        return mel.masked_fill(pad, 0.0)

    def forward(self, hidden: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        if hidden.dim() != 3 or hidden.size(2) != self.in_channels:
            raise ValueError("HIDDEN must have shape [B, T, " + str(self.in_channels) + "]")
        _check_lengths(lengths, hidden.size(0), "LENGTHS")
        return self.decode(hidden.transpose(1, 2), lengths)


class DVAEDecode(nn.Module):
    """``dvae_decode``: CODES [B,T,4] int64, LENGTHS [B] int64 -> MEL [B,100,2T] fp32.

    Codes must lie in [0, levels**4) (625 for ChatTTS); others are clamped (upstream fails on them).
    """

    def __init__(self, arch: Arch):
        super().__init__()
        self.num_codes = arch.vq_groups * arch.vq_residual
        self.vq = GroupedFSQ(arch.vq_dim, arch.vq_levels, arch.vq_groups, arch.vq_residual)
        self.mel = MelDecoder(arch.dvae_decoder)

    def forward(self, codes: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        if codes.dim() != 3 or codes.size(2) != self.num_codes:
            raise ValueError("CODES must have shape [B, T, " + str(self.num_codes) + "]")
        _check_lengths(lengths, codes.size(0), "LENGTHS")
        feats = self.vq.embed(codes.to(torch.int64))  # pointwise in time: padding cannot leak here
        return self.mel.decode(feats.transpose(1, 2), lengths)


def _dft_angles(n_fft: int) -> torch.Tensor:
    """[n_fft//2+1, n_fft] float64 angles 2*pi*k*n/n_fft, reduced mod n_fft for accuracy."""
    n = torch.arange(n_fft, dtype=torch.float64)
    k = torch.arange(n_fft // 2 + 1, dtype=torch.float64)
    return 2 * math.pi * torch.remainder(k[:, None] * n[None, :], n_fft) / n_fft


def _stft_basis(window: torch.Tensor, n_fft: int) -> torch.Tensor:
    """[n_fft, 2*(n_fft//2+1)]: frame @ basis = windowed DFT (real parts, then imaginary parts)."""
    angle = _dft_angles(n_fft)
    w = window.to(torch.float64)[None, :]
    return torch.cat([torch.cos(angle) * w, -torch.sin(angle) * w], 0).T.contiguous().float()


def _istft_basis(window: torch.Tensor, n_fft: int) -> torch.Tensor:
    """[2*(n_fft//2+1), n_fft]: [real | imag] @ basis = windowed inverse real DFT of one frame.

    Norm "backward" (1/n_fft); DC and Nyquist imaginary parts are ignored, as irfft does.
    """
    half = n_fft // 2
    angle = _dft_angles(n_fft)
    weight = torch.full((half + 1, 1), 2.0, dtype=torch.float64)
    weight[0] = 1.0
    weight[half] = 1.0
    w = window.to(torch.float64)[None, :] / n_fft
    real = weight * torch.cos(angle) * w
    imag = -weight * torch.sin(angle) * w
    imag[0] = 0.0
    imag[half] = 0.0
    return torch.cat([real, imag], 0).float()


def frame_signal(x: torch.Tensor, frames: int, n_fft: int, hop: int) -> torch.Tensor:
    """[B, L] -> [B, frames, n_fft], frame f = x[f*hop : f*hop + n_fft]; needs n_fft % hop == 0.

    Reshape into hop-sized blocks and concatenate n_fft//hop shifted views: exact, no gather.
    """
    ratio = n_fft // hop
    blocks = x[:, : (frames + ratio - 1) * hop].reshape(x.size(0), frames + ratio - 1, hop)
    return torch.cat([blocks[:, c : c + frames] for c in range(ratio)], -1)


def overlap_add(frames: torch.Tensor, hop: int) -> torch.Tensor:
    """[B, F, n_fft] -> [B, (F-1)*hop + n_fft], frame f added at f*hop; needs n_fft % hop == 0.

    Sum of n_fft//hop zero-padded shifted block views: plain adds (exact in fp32, unlike a
    conv_transpose that a GPU may run in TF32).
    """
    b, f, n_fft = frames.size(0), frames.size(1), frames.size(2)
    ratio = n_fft // hop
    blocks = frames.reshape(b, f, ratio, hop)
    out = F.pad(blocks[:, :, 0], (0, 0, 0, ratio - 1))
    for c in range(1, ratio):
        out = out + F.pad(blocks[:, :, c], (0, 0, c, ratio - 1 - c))
    return out.reshape(b, (f + ratio - 1) * hop)


class DVAEEncode(nn.Module):
    """``dvae_encode``: AUDIO [1,N] fp32 (24 kHz, N >= 513) -> CODES [1,T,4] int64, T = encode_steps(N).

    Upstream sample_audio: log-mel (torchaudio MelSpectrogram, center, reflect pad, power 1, clip
    1e-5), / coef, downsample_conv (x2 fewer frames), encoder ConvNet, GFSQ quantize. Upstream is
    unbatched; items of a batch here are independent only when they have equal length (no padding).
    """

    def __init__(self, arch: Arch):
        super().__init__()
        dim = arch.dvae_decoder.idim
        self.n_fft, self.hop, self.min_samples, self.log_clip = N_FFT, HOP_LENGTH, MIN_ENCODE_SAMPLES, MEL_LOG_CLIP
        self.register_buffer("coef", torch.ones(1, N_MELS, 1))
        self.register_buffer("window", torch.hann_window(N_FFT))
        self.register_buffer("mel_fb", torch.zeros(N_FFT // 2 + 1, N_MELS))
        self.register_buffer("stft_basis", _stft_basis(self.window, N_FFT), persistent=False)
        self.downsample_conv = nn.ModuleList(
            [nn.Conv1d(N_MELS, dim, 3, 1, 1), nn.GELU(), nn.Conv1d(dim, dim, 4, 2, 1), nn.GELU()]
        )
        self.encoder = ConvNet(arch.dvae_encoder)
        self.vq = GroupedFSQ(arch.vq_dim, arch.vq_levels, arch.vq_groups, arch.vq_residual)

    def refresh_bases(self) -> None:
        """Rebuild the DFT basis from the loaded window."""
        self.stft_basis = _stft_basis(self.window, N_FFT).to(self.window.device)

    def mel_features(self, audio: torch.Tensor) -> torch.Tensor:
        """[B, N] -> log-mel [B, 100, N//256 + 1] fp32 (centered STFT, reflect padding)."""
        x = F.pad(audio.unsqueeze(1), (self.n_fft // 2, self.n_fft // 2), mode="reflect").squeeze(1)
        frames = frame_signal(x, audio.size(1) // self.hop + 1, self.n_fft, self.hop)
        spec = torch.matmul(frames, self.stft_basis)  # [B, F, 2*bins]
        bins = self.n_fft // 2 + 1
        re_part, im_part = spec[:, :, :bins], spec[:, :, bins:]
        mag = torch.sqrt(re_part * re_part + im_part * im_part)
        mel = torch.matmul(mag, self.mel_fb).transpose(1, 2)
        return torch.log(torch.clamp(mel, min=self.log_clip))

    def features(self, audio: torch.Tensor) -> torch.Tensor:
        """[B, N] -> encoder output [B, T, vq_dim] fp32, before quantization."""
        x = self.mel_features(audio.to(torch.float32)) / self.coef
        x = x.to(self.downsample_conv[0].weight.dtype)
        x = self.downsample_conv[1](self.downsample_conv[0](x))
        x = self.downsample_conv[3](self.downsample_conv[2](x))
        pad = torch.zeros((x.size(0), 1, x.size(2)), dtype=torch.bool, device=x.device)
        return self.encoder(x, pad).float().transpose(1, 2)

    def forward(self, audio: torch.Tensor) -> torch.Tensor:
        if audio.dim() != 2:
            raise ValueError("AUDIO must have shape [1, N]")
        if audio.size(1) < self.min_samples:
            raise ValueError("AUDIO needs at least " + str(self.min_samples) + " samples")
        return self.vq.quantize(self.features(audio))


class VocosDecode(nn.Module):
    """``vocos``: MEL [B,100,F] fp32, MEL_LENGTHS [B] int64 -> AUDIO [B,256*(F-1)] fp32.

    Backbone (embed k7, LayerNorm, ConvNeXt blocks, LayerNorm), ISTFTHead (linear -> exp(mag)
    clipped at 1e2, cos/sin phase) and a center ISTFT (n_fft 1024, hop 256, hann). Item b's samples
    past 256*(MEL_LENGTHS[b]-1) are zero; an item of one frame gives no samples (upstream fails on it).
    """

    def __init__(self, dims: VocosDims):
        super().__init__()
        self.embed = nn.Conv1d(N_MELS, dims.dim, kernel_size=VOCOS_KERNEL, padding=VOCOS_KERNEL // 2)
        self.norm = nn.LayerNorm(dims.dim, eps=1e-6)
        self.convnext = nn.ModuleList(
            [ConvNeXtBlock(dims.dim, dims.intermediate, VOCOS_KERNEL, 1) for _ in range(dims.layers)]
        )
        self.final_layer_norm = nn.LayerNorm(dims.dim, eps=1e-6)
        self.head_out = nn.Linear(dims.dim, N_FFT + 2)
        self.n_mels, self.n_fft, self.hop = N_MELS, N_FFT, HOP_LENGTH
        self.mag_clip, self.envelope_eps = VOCOS_MAG_CLIP, ENVELOPE_EPS
        self.register_buffer("window", torch.hann_window(N_FFT))
        self.register_buffer("istft_basis", _istft_basis(self.window, N_FFT), persistent=False)
        self.register_buffer("window_sq", self.window.square(), persistent=False)

    def refresh_bases(self) -> None:
        """Rebuild the inverse-DFT basis and envelope kernel from the loaded window."""
        self.istft_basis = _istft_basis(self.window, N_FFT).to(self.window.device)
        self.window_sq = self.window.square().float()

    def forward(self, mel: torch.Tensor, mel_lengths: torch.Tensor) -> torch.Tensor:
        if mel.dim() != 3 or mel.size(1) != self.n_mels:
            raise ValueError("MEL must have shape [B, " + str(self.n_mels) + ", F]")
        _check_lengths(mel_lengths, mel.size(0), "MEL_LENGTHS")
        frames = mel.size(2)
        pad = padding_mask(mel_lengths, frames)
        x = self.embed(mel.to(self.embed.weight.dtype).masked_fill(pad, 0.0))
        x = self.norm(x.transpose(1, 2)).transpose(1, 2)
        for block in self.convnext:
            x = block(x, pad)
        x = self.head_out(self.final_layer_norm(x.transpose(1, 2))).float()  # [B, F, 2*bins]
        bins = self.n_fft // 2 + 1
        mag = torch.clamp(torch.exp(x[:, :, :bins]), max=self.mag_clip)
        phase = x[:, :, bins:]
        frame_pad = pad.transpose(1, 2)  # [B, F, 1]
        spec = torch.cat([mag * torch.cos(phase), mag * torch.sin(phase)], -1).masked_fill(frame_pad, 0.0)
        # windowed inverse DFT per frame (fp32 matmul), then overlap-add; the envelope counts only
        # this item's own frames, as torch.istft on the item alone does
        y = overlap_add(torch.matmul(spec, self.istft_basis), self.hop)
        envelope = overlap_add((~frame_pad).to(torch.float32) * self.window_sq, self.hop)
        start = self.n_fft // 2
        n_out = self.hop * (frames - 1)
        y = y[:, start : start + n_out]
        envelope = envelope[:, start : start + n_out]
        covered = envelope > self.envelope_eps
        audio = torch.where(covered, y / torch.where(covered, envelope, torch.ones_like(envelope)), torch.zeros_like(y))
        return audio.masked_fill(padding_mask(self.hop * (mel_lengths - 1), n_out).squeeze(1), 0.0)


# --- loading -------------------------------------------------------------------------------------
# artifact -> (regex renames upstream key -> ours, upstream key prefixes that the artifact ignores)
_KEY_MAPS: dict[str, tuple[list[tuple[str, str]], tuple[str, ...]]] = {
    "decoder": ([], ()),
    "dvae_decode": (
        [(r"^vq_layer\.quantizer\.", "vq."), (r"^(coef|decoder\.|out_conv\.)", r"mel.\1")],
        ("encoder.", "downsample_conv.", "preprocessor_mel."),
    ),
    "dvae_encode": (
        [
            (r"^vq_layer\.quantizer\.", "vq."),
            (r"^preprocessor_mel\.mel_spec\.spectrogram\.window$", "window"),
            (r"^preprocessor_mel\.mel_spec\.mel_scale\.fb$", "mel_fb"),
        ],
        ("decoder.", "out_conv."),
    ),
    "vocos": (
        [
            (r"^backbone\.convnext\.(\d+)\.gamma$", r"convnext.\1.weight"),
            (r"^backbone\.", ""),
            (r"^head\.out\.", "head_out."),
            (r"^head\.istft\.window$", "window"),
        ],
        ("feature_extractor.",),
    ),
}


def build_codec(name: str, arch: Arch) -> nn.Module:
    """An artifact's module with the given dims and unloaded weights."""
    if name == "decoder":
        return MelDecoder(arch.decoder)
    if name == "dvae_decode":
        return DVAEDecode(arch)
    if name == "dvae_encode":
        return DVAEEncode(arch)
    if name == "vocos":
        return VocosDecode(arch.vocos)
    raise ValueError(f"unknown codec artifact {name!r}; expected one of {', '.join(CODEC_NAMES)}")


def load_codec_state(module: nn.Module, name: str, state: dict[str, torch.Tensor], file: str) -> nn.Module:
    """Load an upstream state dict into `module`; AssetError names `file` on any mismatch."""
    renames, ignored = _KEY_MAPS[name]
    mapped: dict[str, torch.Tensor] = {}
    origin: dict[str, str] = {}
    for key, tensor in state.items():
        if key.startswith(ignored):
            continue
        ours = key
        for pattern, repl in renames:
            ours, hits = re.subn(pattern, repl, ours)
            if hits:
                break
        mapped[ours] = tensor
        origin[ours] = key
    own = module.state_dict()
    missing = sorted(k for k in own if k not in mapped)
    unexpected = sorted(origin[k] for k in mapped if k not in own)
    if missing or unexpected:
        raise AssetError(
            f"{file}: not the upstream {name} weights (missing {missing[:4]}{'…' if len(missing) > 4 else ''}, "
            f"unexpected {unexpected[:4]}{'…' if len(unexpected) > 4 else ''})"
        )
    for key, tensor in mapped.items():
        if tuple(tensor.shape) != tuple(own[key].shape):
            raise AssetError(
                f"{file}: tensor {origin[key]!r} has shape {tuple(tensor.shape)}, expected {tuple(own[key].shape)}"
            )
        if not tensor.is_floating_point():
            raise AssetError(f"{file}: tensor {origin[key]!r} is {tensor.dtype}, expected a float tensor")
    module.load_state_dict({k: v.float() for k, v in mapped.items()}, strict=True)
    if hasattr(module, "refresh_bases"):
        module.refresh_bases()
    return module.eval()


def load_codec(
    name: str,
    assets_dir: Path,
    arch: Arch | None = None,
    states: dict[str, dict[str, torch.Tensor]] | None = None,
) -> nn.Module:
    """The artifact `name` with the upstream weights of `assets_dir` (fp32, CPU, eval mode).

    `arch` defaults to `infer_arch(assets_dir)`; `states` caches loaded files across calls.
    """
    if name not in CODEC_NAMES:
        raise ValueError(f"unknown codec artifact {name!r}; expected one of {', '.join(CODEC_NAMES)}")
    states = {} if states is None else states
    assets_dir = Path(assets_dir)
    file = CODEC_ASSET_FILES[name]
    if file not in states:
        states[file] = load_safetensors(assets_dir / file)
    if arch is None:
        arch = infer_arch(assets_dir, states)
    module = build_codec(name, arch)
    return load_codec_state(module, name, states[file], str(assets_dir / file))


def load_codecs(
    assets_dir: Path, arch: Arch | None = None, names: Sequence[str] = CODEC_NAMES
) -> dict[str, nn.Module]:
    """{name: module} for `names`, each file read once."""
    states: dict[str, dict[str, torch.Tensor]] = {}
    return {name: load_codec(name, assets_dir, arch, states) for name in names}


def codec_eager_from_script(script, name: str, arch: Arch) -> nn.Module:
    """The plain module holding an exported codec artifact's weights and buffers, as exported (dtype, device): what
    torch.compile traces (it cannot trace TorchScript). AssetError where the artifact is not this architecture's."""
    module = build_codec(name, arch)
    sd = dict(script.state_dict())  # TorchScript keeps the non-persistent buffers in it too
    targets = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    missing = sorted(set(module.state_dict()) - set(sd))
    unexpected = sorted(set(sd) - set(targets))
    if missing or unexpected:
        raise AssetError(f"the {name} artifact does not hold this architecture's weights (missing {missing[:4]}, "
                         f"unexpected {unexpected[:4]})")
    for key, tensor in sd.items():
        if tuple(tensor.shape) != tuple(targets[key].shape):
            raise AssetError(f"the {name} artifact's {key!r} has shape {tuple(tensor.shape)}, "
                             f"expected {tuple(targets[key].shape)}")
        targets[key].data = tensor.detach().clone()
    return module.to(next(iter(sd.values())).device).eval()  # the device only: each tensor keeps its dtype


def cast_codec(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Cast the network weights to `dtype`; keep fp32 where precision matters.

    Kept fp32: coef, STFT/ISTFT bases, windows, mel filterbank, the quantizer (upstream forces its
    FSQ math to fp32). Inputs and outputs stay fp32 (the artifact contract).
    """
    if isinstance(module, MelDecoder):
        module.decoder.to(dtype)
        module.out_conv.to(dtype)
    elif isinstance(module, DVAEDecode):
        cast_codec(module.mel, dtype)
    elif isinstance(module, DVAEEncode):
        module.downsample_conv.to(dtype)
        module.encoder.to(dtype)
    elif isinstance(module, VocosDecode):
        for part in (module.embed, module.norm, module.convnext, module.final_layer_norm, module.head_out):
            part.to(dtype)
    else:
        raise TypeError(f"not a codec module: {type(module).__name__}")
    return module
