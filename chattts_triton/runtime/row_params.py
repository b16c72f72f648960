"""Each engine slot's generation state on the device, by name.

The state is packed: one int64 and one float32 tensor with a row per slot and a column per field, so that
one copy moves a row (admission, suspend, resume), one gather a batch (a step), and the CUDA graphs read
fixed addresses. `RowParams` wraps such a pair of tensors (the engine's, a few rows of them, or a host
copy) and names the columns: `rows.seed` is the view `ints[:, 4]`, writable in place. `RowParams.of` is the
one place a request's fields (`SamplingParams` and the rest) become a row.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from ..config import AUDIO_EOS

# columns of `ints` and of `floats`, in order
INT_FIELDS = ("n", "prompt_len", "top_k", "min_new_tokens", "seed", "attempt", "eos", "text")
FLOAT_FIELDS = ("temperature", "top_p", "repetition_penalty")
# a free slot: free slots pad the graph buckets, so every id it holds must index the code head (the audio
# EOS, not a text EOS), and n = prompt_len = 0 (nothing in its history is read)
FREE_INTS = (0, 0, 0, 0, 0, 0, AUDIO_EOS, 0)
FREE_FLOATS = (1.0, 1.0, 1.0)


def _column(kind: str, j: int, doc: str) -> property:
    def get(self: RowParams) -> Tensor:
        return getattr(self, kind)[:, j]

    return property(get, doc=doc)


class RowParams:
    """ints [rows, len(INT_FIELDS)] int64 and floats [rows, len(FLOAT_FIELDS)] float32, one row per slot."""

    __slots__ = ("ints", "floats")

    def __init__(self, ints: Tensor, floats: Tensor):
        self.ints = ints
        self.floats = floats

    n = _column("ints", 0, "tokens generated and kept so far (a step feeds token n-1 at position prompt_len + n - 1)")
    prompt_len = _column("ints", 1, "prompt positions (text + audio prompt codes)")
    top_k = _column("ints", 2, "top-K (0: off)")
    min_new_tokens = _column("ints", 3, "EOS is masked until n reaches this")
    seed = _column("ints", 4, "the request's seed: its draws depend on (seed, n, code row, attempt) only")
    attempt = _column("ints", 5, "first-token redraws so far (ensure_non_empty)")
    eos = _column("ints", 6, "the EOS id of its head (code: AUDIO_EOS; text: the tokenizer's)")
    text = _column("ints", 7, "1: refine-text mode (the text head), 0: audio codes")
    temperature = _column("floats", 0, "temperature")
    top_p = _column("floats", 1, "top-P (1.0: off)")
    repetition_penalty = _column("floats", 2, "repetition penalty over the last REPETITION_WINDOW tokens")

    @classmethod
    def free(cls, rows: int, device: torch.device | str = "cpu") -> RowParams:
        """`rows` free slots' state."""
        return cls(torch.tensor(FREE_INTS, dtype=torch.int64, device=device).repeat(rows, 1),
                   torch.tensor(FREE_FLOATS, dtype=torch.float32, device=device).repeat(rows, 1))

    @classmethod
    def of(cls, reqs: Sequence) -> RowParams:
        """The host rows of freshly admitted requests (`GenRequest`s): nothing generated yet."""
        ints, floats = [], []
        for r in reqs:
            p = r.params
            row = dict(n=0, prompt_len=r.prompt_len, top_k=0 if p.top_k is None else p.top_k,
                       min_new_tokens=p.min_new_tokens, seed=p.seed, attempt=0, eos=r.eos_id,
                       text=int(r.mode == "text"))
            ints.append([row[f] for f in INT_FIELDS])
            frow = dict(temperature=p.temperature, top_p=1.0 if p.top_p is None else p.top_p,
                        repetition_penalty=p.repetition_penalty)
            floats.append([frow[f] for f in FLOAT_FIELDS])
        return cls(torch.tensor(ints, dtype=torch.int64), torch.tensor(floats, dtype=torch.float32))

    def narrow(self, start: int, length: int) -> RowParams:
        """Rows start..start+length-1, as views (writes land in self)."""
        return RowParams(self.ints.narrow(0, start, length), self.floats.narrow(0, start, length))

    def select(self, rows: Tensor) -> RowParams:
        """A copy of the rows `rows` (int64 indices)."""
        return RowParams(self.ints.index_select(0, rows), self.floats.index_select(0, rows))

    def map(self, fn: Callable[[Tensor], Tensor]) -> RowParams:
        """fn applied to both tensors (say, a copy to the device)."""
        return RowParams(fn(self.ints), fn(self.floats))

    def copy_(self, src: RowParams) -> RowParams:
        """src's rows into these (src may be one row: it is broadcast)."""
        self.ints.copy_(src.ints)
        self.floats.copy_(src.floats)
        return self
