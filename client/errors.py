"""One exception type for every failure, carrying a canonical (gRPC-style) Triton status.

gRPC and HTTP report the same server error differently ("StatusCode.INVALID_ARGUMENT" vs HTTP 400),
and connection failures surface as plain OSErrors. `to_chattts_error` folds all of them into
`ChatTTSError(status, message)` so callers, the retry policy and the load tests see one vocabulary.
"""

from __future__ import annotations

import re
import sys

# Canonical status names (gRPC's). Triton's HTTP server maps its error codes onto these HTTP codes.
UNAVAILABLE = "UNAVAILABLE"
INVALID_ARGUMENT = "INVALID_ARGUMENT"
DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
NOT_FOUND = "NOT_FOUND"
INTERNAL = "INTERNAL"
UNKNOWN = "UNKNOWN"
CANCELLED = "CANCELLED"
CLIENT_ERROR = "CLIENT_ERROR"  # raised by tritonclient itself, before anything reached a server

HTTP_STATUS = {
    "400": INVALID_ARGUMENT,
    "404": NOT_FOUND,
    "408": DEADLINE_EXCEEDED,
    "429": "RESOURCE_EXHAUSTED",
    "499": CANCELLED,
    "500": INTERNAL,
    "501": "UNIMPLEMENTED",
    "502": UNAVAILABLE,  # a proxy in front of a server that is down
    "503": UNAVAILABLE,
    "504": DEADLINE_EXCEEDED,
}

# Only these are worth retrying: the server was not reached or asked us to come back (queue full,
# model loading, shutting down). Everything else would fail the same way again.
RETRYABLE = frozenset({UNAVAILABLE})


class ChatTTSError(Exception):
    """A request failed. `status` is a canonical name such as INVALID_ARGUMENT or UNAVAILABLE."""

    def __init__(self, status: str, message: str):
        super().__init__(f"[{status}] {message}")
        self.status = status
        self.message = message

    @property
    def retryable(self) -> bool:
        return self.status in RETRYABLE


class ChatTTSInputError(ChatTTSError, ValueError):
    """Rejected by the client before sending: wrong type, unknown option, empty text."""

    def __init__(self, message: str):
        super().__init__(INVALID_ARGUMENT, message)


class ChatTTSUnavailableError(ChatTTSError):
    """The server could not be reached (or kept answering UNAVAILABLE) after every retry."""

    def __init__(self, message: str):
        super().__init__(UNAVAILABLE, message)


def normalize_status(raw: str | None) -> str:
    """'StatusCode.INVALID_ARGUMENT' / '400' / None -> 'INVALID_ARGUMENT' / 'INVALID_ARGUMENT' / CLIENT_ERROR."""
    if raw is None:
        return CLIENT_ERROR
    raw = str(raw)
    if raw.startswith("StatusCode."):
        return raw[len("StatusCode.") :]
    if raw in HTTP_STATUS:
        return HTTP_STATUS[raw]
    if raw.isdigit():
        return INTERNAL if raw.startswith("5") else f"HTTP_{raw}"
    return raw.upper()


def _is_aiohttp_connection_error(exc: BaseException) -> bool:
    aiohttp = sys.modules.get("aiohttp")
    return aiohttp is not None and isinstance(exc, aiohttp.ClientConnectionError)


def to_chattts_error(exc: BaseException, where: str = "") -> ChatTTSError:
    """Map any exception raised by a tritonclient call to a ChatTTSError (returned, not raised)."""
    if isinstance(exc, ChatTTSError):
        return exc
    from tritonclient.utils import InferenceServerException

    prefix = f"{where}: " if where else ""
    if isinstance(exc, InferenceServerException):
        status = normalize_status(exc.status())
        message = exc.message() or str(exc)
        return ChatTTSError(status, prefix + message)
    # TimeoutError covers socket.timeout and asyncio.TimeoutError (3.11); check it before OSError.
    if isinstance(exc, TimeoutError) or type(exc).__name__ == "Timeout":  # gevent.Timeout
        return ChatTTSError(DEADLINE_EXCEEDED, prefix + f"timed out ({type(exc).__name__}: {exc})")
    if isinstance(exc, OSError) or _is_aiohttp_connection_error(exc):
        return ChatTTSError(UNAVAILABLE, prefix + f"connection failed ({type(exc).__name__}: {exc})")
    return ChatTTSError(UNKNOWN, prefix + f"{type(exc).__name__}: {exc}")


# Triton 2.51 sends the error of a streamed request as a message only (gRPC ModelStreamInferResponse
# error_message, HTTP SSE `{"error": ...}`, HTTP 400 whatever the code): the status is read from it.
# A message may name its status first ("UNAVAILABLE: ..."); else the server's wording decides, and
# what is left is the server's input validation.
_STATUS_PREFIX = re.compile(r"^\[?([A-Z_]+)\]?:?\s")
_KNOWN_STATUSES = frozenset({UNAVAILABLE, INVALID_ARGUMENT, DEADLINE_EXCEEDED, NOT_FOUND, INTERNAL, UNKNOWN, CANCELLED,
                             "RESOURCE_EXHAUSTED", "UNIMPLEMENTED"})  # fmt: skip
_STREAM_HINTS = (
    (UNAVAILABLE, ("retry later", "retry on another instance", "shutting down", "exceeds maximum queue size")),
    (NOT_FOUND, ("unknown model",)),
    (INTERNAL, ("internal error", "failed to process the request", "stub process")),
    (CANCELLED, ("cancelled",)),
)


def stream_error_status(message: str) -> str:
    """Canonical status of a streamed request's error message (see above)."""
    m = _STATUS_PREFIX.match(message)
    if m and m.group(1) in _KNOWN_STATUSES:
        return m.group(1)
    low = message.lower()
    for status, hints in _STREAM_HINTS:
        if any(h in low for h in hints):
            return status
    return INVALID_ARGUMENT


def stream_error(message: str, status: str | None = None):
    """The InferenceServerException to raise for an error response of a stream."""
    from tritonclient.utils import InferenceServerException

    return InferenceServerException(message, status=status or stream_error_status(message))
