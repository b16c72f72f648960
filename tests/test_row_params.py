"""Each slot's sampling state by name (chattts_triton/runtime/row_params.py): a request's fields land in their named
columns of the two packed tensors, the names are views of those tensors (writable in place, what CUDA graphs
read), and a free row is what graph padding needs."""

from __future__ import annotations

import torch

from chattts_triton.config import AUDIO_EOS
from chattts_triton.runtime.engine import GenRequest, SamplingParams
from chattts_triton.runtime.row_params import FLOAT_FIELDS, INT_FIELDS, RowParams


def test_a_requests_fields_land_in_their_named_columns():
    code = GenRequest(torch.arange(5), SamplingParams(0.3, 0.7, 20, 1.05, 100, 10, seed=1234), None,
                      audio_codes=torch.zeros(3, 4, dtype=torch.int64))
    text = GenRequest(torch.arange(9), SamplingParams(0.7, None, None, 1.0, 50, 0, seed=7), None, mode="text",
                      eos_id=21140)
    rows = RowParams.of([code, text])
    assert rows.ints.shape == (2, len(INT_FIELDS)) and rows.floats.shape == (2, len(FLOAT_FIELDS))
    assert rows.ints.dtype == torch.int64 and rows.floats.dtype == torch.float32
    assert rows.n.tolist() == [0, 0] and rows.attempt.tolist() == [0, 0]
    assert rows.prompt_len.tolist() == [5 + 3, 9]  # text, then the audio prompt's codes
    assert rows.top_k.tolist() == [20, 0]  # None: off
    assert rows.min_new_tokens.tolist() == [10, 0] and rows.seed.tolist() == [1234, 7]
    assert rows.eos.tolist() == [AUDIO_EOS, 21140] and rows.text.tolist() == [0, 1]
    assert torch.equal(rows.temperature, torch.tensor([0.3, 0.7]))
    assert torch.equal(rows.top_p, torch.tensor([0.7, 1.0]))  # None: off
    assert torch.equal(rows.repetition_penalty, torch.tensor([1.05, 1.0]))


def test_names_are_views_of_the_packed_tensors_and_narrow_writes_through_while_select_copies():
    rows = RowParams.free(4)
    for j, name in enumerate(INT_FIELDS):
        col = getattr(rows, name)
        assert col.data_ptr() == rows.ints[:, j].data_ptr() and col.stride() == rows.ints[:, j].stride()
    for j, name in enumerate(FLOAT_FIELDS):
        assert getattr(rows, name).data_ptr() == rows.floats[:, j].data_ptr()
    rows.seed.fill_(9)
    rows.narrow(1, 2).temperature.fill_(0.5)
    rows.narrow(2, 1).copy_(RowParams.of([GenRequest(torch.arange(3),
                                                     SamplingParams(0.2, 0.9, 5, 1.1, 8, 8, seed=3), None)]))
    assert rows.seed.tolist() == [9, 9, 3, 9] and torch.equal(rows.temperature, torch.tensor([1.0, 0.5, 0.2, 1.0]))
    picked = rows.select(torch.tensor([2, 0]))
    picked.seed.fill_(-1)
    assert picked.top_k.tolist() == [5, 0] and rows.seed.tolist() == [9, 9, 3, 9]


def test_a_free_row_indexes_the_code_head_and_reads_no_history():
    rows = RowParams.free(3)
    assert rows.eos.tolist() == [AUDIO_EOS] * 3 and rows.n.tolist() == [0] * 3 and rows.prompt_len.tolist() == [0] * 3
    assert (rows.floats == 1).all() and rows.text.tolist() == [0] * 3
    rows.narrow(0, 2).copy_(RowParams.of([GenRequest(torch.arange(3),
                                                     SamplingParams(0.2, 0.9, 5, 1.1, 8, 8, seed=3), None,
                                                      mode="text", eos_id=21140)] * 2))
    rows.narrow(0, 2).copy_(RowParams.free(1))  # one free row, broadcast: how the engine resets slots
    assert torch.equal(rows.ints, RowParams.free(3).ints) and torch.equal(rows.floats, RowParams.free(3).floats)
