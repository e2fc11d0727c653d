"""The DiT over packed rows (`engine.models.packed_rows`) against its padded call.

Packing leaves each row's frames past its end out of the blocks' matrix products; the
velocity of every real frame must be the padded call's: with no prefix, with one voice's
shared prompt prefix, with that prefix attended apart (`split_prefix_rows`), and compiled."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

from engine.models.config import ModelConfig
from engine.models.dit import CONV_CONTEXT, DiT, DiTPrefix, SplitMasks
from engine.models.packed_rows import PackedRows, forward_packed, packed_mask
from engine.models.flow import init_random_

CHUNK = 4  # frames a block: small, so rows span several blocks


@pytest.fixture(scope="module")
def dit() -> DiT:
    torch.manual_seed(0)
    model = DiT(replace(ModelConfig.tiny().flow, static_chunk_size=CHUNK))
    init_random_(model, seed=3)
    return model.eval()


def _inputs(lengths: list[int], length: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    batch = len(lengths)
    mask = (torch.arange(length)[None, :] < torch.tensor(lengths)[:, None]).float().unsqueeze(1)
    # Padded frames hold noise, not zeros: a packed call must not read them at all.
    return {"x": torch.randn(batch, 80, length, generator=g), "mu": torch.randn(batch, 80, length, generator=g),
            "cond": torch.randn(batch, 80, length, generator=g), "spks": torch.randn(batch, 80, generator=g),
            "mask": mask}


def _shared_prefix(dit: DiT, batch: int, width: int, seed: int) -> DiTPrefix:
    g = torch.Generator().manual_seed(seed)
    attn = dit.transformer_blocks[0].attn
    kv = [(torch.randn(2, attn.heads, width, attn.dim_head, generator=g),
           torch.randn(2, attn.heads, width, attn.dim_head, generator=g)) for _ in dit.transformer_blocks]
    dim = dit.norm_out.linear.in_features
    return DiTPrefix(layer_kv=kv, key_mask=torch.ones(batch, width, dtype=torch.bool),
                     positions=torch.full((batch,), width, dtype=torch.long),
                     conv_context=torch.randn(2, CONV_CONTEXT, dim, generator=g), shared=True)


def _compare(dit: DiT, lengths: list[int], prefix: DiTPrefix | None, length: int | None = None,
             prebuilt: bool = False) -> None:
    length = length or max(lengths)
    inp = _inputs(lengths, length, seed=5)
    t = torch.tensor([0.37])
    time = dit.time_conditioning(t)[0]
    rows = PackedRows.of(lengths, "cpu", length)
    mask = packed_mask(dit, rows, prefix, torch.float32) if prebuilt else None
    with torch.no_grad():
        padded = dit(inp["x"], inp["mask"], inp["mu"], t, inp["spks"], inp["cond"], streaming=True, prefix=prefix,
                     time=time)
        packed = forward_packed(dit, inp["x"], mu=inp["mu"], spks=inp["spks"], cond=inp["cond"], rows=rows,
                                time=time, prefix=prefix, mask=mask)
    real = inp["mask"].bool().expand_as(padded)
    assert packed.shape == padded.shape
    assert torch.allclose(packed[real], padded[real], atol=1e-5, rtol=1e-4), (packed - padded)[real].abs().max()
    assert not packed[~real].any()  # nothing past a row's end


@pytest.mark.parametrize("kernel", ["sdpa", "cudnn"])  # cudnn's bias goes through SDPA off CUDA
@pytest.mark.parametrize("with_prefix", [False, True])
def test_packed_velocity_is_the_padded_one_on_every_real_frame(dit: DiT, with_prefix: bool, kernel: str) -> None:
    half = [3, 11, 7]  # a first chunk's few frames beside longer rows, blocks cut mid-row
    lengths = half + [n + 1 if n < 11 else n for n in half]  # the halves need not be alike
    dit.use_attention_kernel(kernel)
    try:
        _compare(dit, lengths, _shared_prefix(dit, len(lengths), 2 * CHUNK, seed=6) if with_prefix else None,
                 prebuilt=with_prefix)
    finally:
        dit.use_attention_kernel("sdpa")


def test_packed_rows_with_the_prefix_attended_apart(dit: DiT) -> None:
    lengths = [2, 9, 9, 5, 3, 9, 8, 5]  # uneven halves
    prefix = _shared_prefix(dit, len(lengths), 2 * CHUNK, seed=8)
    before, dit.split_prefix_rows = dit.split_prefix_rows, 4
    try:
        mask = packed_mask(dit, PackedRows.of(lengths, "cpu"), prefix, torch.float32)
        assert isinstance(mask.inner, SplitMasks)  # the path under test
        _compare(dit, lengths, prefix, length=12)  # padded past the longest, as to a graph's bucket
    finally:
        dit.split_prefix_rows = before


@pytest.mark.parametrize("case", ["prefix", "split", "none"])
def test_packed_rows_compiled(dit: DiT, case: str) -> None:
    compiled = copy.deepcopy(dit)
    compiled.split_prefix_rows = 2 if case == "split" else 0
    compiled.compile_blocks()
    lengths = [4, 10, 4, 10]
    _compare(compiled, lengths, None if case == "none" else _shared_prefix(compiled, 4, 2 * CHUNK, seed=9))


def test_packed_rows_layout() -> None:
    rows = PackedRows.of([2, 3, 1, 2], "cpu", length=4)
    assert rows.frames == 8
    assert rows.row_of.tolist() == [0, 0, 1, 1, 1, 2, 3, 3]
    assert rows.local.tolist() == [0, 1, 0, 1, 2, 0, 0, 1]
    assert rows.gather.tolist() == [[0, 1, 0, 0], [2, 3, 4, 0], [5, 0, 0, 0], [6, 7, 0, 0]]
    assert rows.scatter.tolist() == [0, 1, 4, 5, 6, 8, 12, 13]
    padded = torch.arange(4 * 4 * 2, dtype=torch.float32).view(4, 4, 2)
    again = rows.unpack(rows.pack(padded))
    keep = rows.pad_mask()
    assert torch.equal(again[keep], padded[keep]) and not again[~keep].any()
    with pytest.raises(ValueError):
        PackedRows.of([2, 3, 1], "cpu")  # not two CFG halves
    with pytest.raises(ValueError):
        PackedRows.of([2, 5], "cpu", length=4)  # a row past the padded length


def test_packed_rows_refuse_what_they_cannot_run(dit: DiT) -> None:
    lengths = [3, 5]
    inp = _inputs(lengths, 5, seed=1)
    rows = PackedRows.of(lengths, "cpu")
    args = {"mu": inp["mu"], "spks": inp["spks"], "cond": inp["cond"], "rows": rows}
    per_row_times = dit._split_time(dit._time_vectors(torch.tensor([0.1, 0.2])))
    with pytest.raises(ValueError, match="one flow time"):
        forward_packed(dit, inp["x"], **args, time=per_row_times)
    time = dit.time_conditioning(torch.tensor([0.1]))[0]
    with pytest.raises(ValueError, match="do not fit"):
        forward_packed(dit, inp["x"][:, :, :4], **args, time=time)
    shared = _shared_prefix(dit, 2, 2 * CHUNK, seed=2)
    for prefix in (replace(shared, shared=False), replace(shared, ring_kv=shared.layer_kv),
                   replace(shared, sink=object())):  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="one voice"):
            forward_packed(dit, inp["x"], **args, time=time, prefix=prefix)
    other = packed_mask(dit, PackedRows.of([3, 3, 3, 3], "cpu"), None, torch.float32)
    with pytest.raises(ValueError, match="other rows"):
        forward_packed(dit, inp["x"], **args, time=time, mask=other)
    block = dit.transformer_blocks[0].attn
    with pytest.raises(ValueError, match="keep no keys"):
        x = torch.randn(1, rows.frames, dit.norm_out.linear.in_features)
        angles = dit.rotary_embed.at(rows.local)
        block(x, packed_mask(dit, rows, None, torch.float32), torch.ones(1, rows.frames, dtype=torch.bool),
              (angles.cos(), angles.sin()), keep_kv=True)
