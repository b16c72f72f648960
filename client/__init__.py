"""Client of the `chattts` Triton ensemble: `ChatTTSClient` / `AsyncChatTTSClient` (one server),
`BalancedChatTTSClient` / `AsyncBalancedChatTTSClient` (several, with failover), WAV helpers,
and the command line (`python -m client --help`)."""

from .audio import WavError, load_reference_audio, read_wav, save_wav
from .balancer import AsyncBalancedChatTTSClient, BalancedChatTTSClient
from .client import AsyncChatTTSClient, ChatTTSClient, split_sentences
from .contract import MODEL, SAMPLE_RATE, build_inputs
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
    "WavError",
    "build_inputs",
    "load_reference_audio",
    "read_wav",
    "save_wav",
    "split_sentences",
]
