"""Client of the `chattts` Triton ensemble (and its streaming twin `chattts_stream`, through
`stream()`): `ChatTTSClient` / `AsyncChatTTSClient` (one server), `BalancedChatTTSClient` /
`AsyncBalancedChatTTSClient` (several, with failover), the options of a request (`SynthesisOptions`), WAV helpers,
and the command line (`python -m client --help`)."""

from .audio import WavError, WavStreamWriter, load_reference_audio, read_wav, save_wav
from .balancer import AsyncBalancedChatTTSClient, BalancedChatTTSClient
from .client import AsyncChatTTSClient, ChatTTSClient, split_sentences
from .contract import MODEL, SAMPLE_RATE, STREAM_MODEL, SynthesisOptions, build_inputs
from .errors import ChatTTSError, ChatTTSInputError, ChatTTSUnavailableError

__all__ = [
    "AsyncBalancedChatTTSClient",
    "AsyncChatTTSClient",
    "BalancedChatTTSClient",
    "ChatTTSClient",
    "ChatTTSError",
    "ChatTTSInputError",
    "ChatTTSUnavailableError",
    "MODEL",
    "SAMPLE_RATE",
    "STREAM_MODEL",
    "SynthesisOptions",
    "WavError",
    "WavStreamWriter",
    "build_inputs",
    "load_reference_audio",
    "read_wav",
    "save_wav",
    "split_sentences",
]
