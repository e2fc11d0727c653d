"""The Triton kernel for the DiT's split attention (`engine.models.split_attention_kernel`).

Its arithmetic runs here under Triton's interpreter (`TRITON_INTERPRET=1`, on the CPU in
float32, in a fresh interpreter process), through `run_interpreted` of the convolution
kernel's tests, against the two attentions and their merge that `dit.split_prefix_attention`
computes otherwise."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.models import split_attention_kernel
from engine.models.dit import attention_kernel_for
from tests.test_causal_conv_kernel import run_interpreted


def test_the_kernel_is_the_split_attention_and_its_merge() -> None:
    """Rows, heads and frames below, at and across a tile (64) of queries and of keys, a
    prompt shorter than a tile and one ending mid-tile, keys masked at random, the biases
    as the DiT makes them (rows padded to 8 elements), q, k and v as views of one
    projection and the prompt's keys a slice of a wider cache; one case sees no key in its
    first block of prompt keys (the online softmax's guard against -inf); through
    `split_prefix_attention` with the kernel named in its masks, against the same call
    with the torch formula, with the shipped launch settings and two others. And the trial
    the stage makes before it takes the kernel."""
    out = run_interpreted("""
        import torch
        from engine.models import split_attention_kernel as sak
        from engine.models.dit import SplitMasks, attention_bias, split_prefix_attention
        torch.manual_seed(0)
        worst = 0.0
        for rows, heads, length, width, own, dh, blind in ((1, 2, 5, 3, 7, 16, 0), (2, 3, 70, 90, 130, 32, 0),
                                                           (3, 2, 64, 64, 64, 16, 0), (2, 1, 9, 150, 20, 16, 70)):
            batch = 2 * rows
            q = torch.randn(batch, length, 3 * heads * dh)[..., : heads * dh].view(batch, length, heads, dh)
            q = q.transpose(1, 2)  # strided, as the projection's split leaves it
            kv = torch.randn(batch, own, 2 * heads * dh)
            k, v = (t.reshape(batch, own, heads, dh).transpose(1, 2) for t in kv.split(heads * dh, dim=-1))
            cache = torch.randn(2, 2, heads, width + 5, dh)
            pk, pv = cache[0, :, :, 2:width + 2], cache[1, :, :, 2:width + 2]  # slices of a wider cache
            seen = torch.rand(2, 1, 1, width) > 0.2
            seen[..., blind] = True
            seen[..., :blind] = False  # no prompt key in the first block of keys
            mine = torch.rand(batch, 1, length, own) > 0.3
            masks = SplitMasks(attention_bias(seen, torch.float32), attention_bias(mine, torch.float32), "sdpa")
            assert masks.own.stride(2) % 8 == 0 and masks.own.stride(2) >= own
            want = split_prefix_attention(q, k, v, (pk, pv), masks)
            got = split_prefix_attention(q, k, v, (pk, pv), masks._replace(kernel="triton"))
            assert got.shape == want.shape == (batch, length, heads * dh) and bool(got.isfinite().all())
            worst = max(worst, float((got - want).abs().max()))
            # Other launch settings (`bench.split_attention_tune`'s): tiles of queries and
            # steps of keys smaller and larger than the shipped ones give the same attention.
            for config in (sak.LaunchConfig(16, 32, 4, 2), sak.LaunchConfig(128, 16, 8, 3)):
                other = sak.launch(q, k, v, pk, pv, masks.prefix, masks.own, config)
                worst = max(worst, float((other - want).abs().max()))
        print(sak._trial(torch.device("cpu"), torch.float32))
        print(worst)
    """)
    trial, worst = out.strip().splitlines()[-2:]
    assert trial == "True" and float(worst) < 1e-5


def test_without_the_interpreter_the_cpu_keeps_the_torch_path() -> None:
    """Off the interpreter the CPU has no kernel, so "triton" is chosen as "cudnn" there
    (whose bias goes through SDPA on the CPU)."""
    cpu = torch.device("cpu")
    if os.environ.get("TRITON_INTERPRET") != "1":
        assert not split_attention_kernel.runs_on(cpu, torch.float32)
        assert attention_kernel_for("triton", cpu, torch.float32, lambda d, t: True) == "cudnn"
        if split_attention_kernel._triton() is not None:  # a launch off the interpreter fails: the trial says no
            assert not split_attention_kernel._trial(cpu, torch.float32)
    assert not split_attention_kernel.runs_on(cpu, torch.float64)
    assert not split_attention_kernel.runs_on(torch.device("cuda", 0), torch.float32)  # tf32 dots


def test_triton_attention_is_cudnn_where_the_batch_is_not_split() -> None:
    """The setting is accepted; its calls not split at the prompt take cuDNN's additive bias,
    so a GPU where cuDNN does not run falls back to SDPA as "cudnn" does."""
    assert EngineConfig(model_dir=Path("."), flow_attention="triton").flow_attention == "triton"
    gpu = torch.device("cuda", 0)
    if split_attention_kernel.runs_on(gpu, torch.bfloat16):  # Triton imports (on Linux it does)
        assert attention_kernel_for("triton", gpu, torch.bfloat16, lambda d, t: True) == "triton"
    assert attention_kernel_for("triton", gpu, torch.bfloat16, lambda d, t: False) == "sdpa"
    assert attention_kernel_for("triton", gpu, torch.float32, lambda d, t: True) == "cudnn"
    from engine.models.config import ModelConfig
    from engine.models.flow import CausalMaskedDiffWithDiT
    from engine.token2wav import AudioStage

    flow = CausalMaskedDiffWithDiT(ModelConfig.tiny().flow)
    AudioStage(flow, torch.nn.Linear(1, 1), torch.device("cpu"), flow_attention="triton")
    dit = flow.decoder.estimator
    assert dit.attention_kernel == ("triton" if os.environ.get("TRITON_INTERPRET") == "1" else "cudnn")
    dit.use_attention_kernel("triton")
    bias = dit.block_masks(torch.tensor([[[[True, False], [True, True]]]]), None, torch.float32)
    assert bias.tolist() == [[[[0.0, float("-inf")], [0.0, 0.0]]]]  # cuDNN's additive bias


def test_the_accuracy_bench_checks_the_kernel_where_it_runs(tmp_path: Path) -> None:
    """`bench.split_attention_check` takes the kernel in where it runs (here: the
    interpreter) and finds it as close to float64 as the torch formula in float32."""
    out = tmp_path / "split.json"
    run_interpreted(f"""
        from bench import split_attention_check
        split_attention_check.main(["--device", "cpu", "--shapes", "2:60:10:20", "--json", {str(out)!r}])
    """)
    results = json.loads(out.read_text())["results"]
    assert [r["kernel"] for r in results] == ["sdpa", "cudnn", "triton"]
    assert results[2]["lse_max_abs_err"] is None and results[2]["max_abs_err"] < 1e-5


def test_the_kernel_is_one_operator_to_torch_compile() -> None:
    """The DiT's blocks run under torch.compile (dynamic shapes): the kernel goes through it
    as one operator (`cosyvoice::split_prefix_attention`, and `..._rotary` with head 0
    apart, their shapes from their fakes), with no graph break, and gives what it gives
    uncompiled."""
    out = run_interpreted("""
        import torch
        from engine.models.dit import SplitMasks, split_prefix_attention
        torch.manual_seed(0)
        batch, heads, length, width, own, dh = 4, 2, 10, 12, 14, 16
        args = (torch.randn(batch, length, heads, dh).transpose(1, 2), torch.randn(batch, heads, own, dh),
                torch.randn(batch, heads, own, dh), torch.randn(2, heads, width, dh), torch.randn(2, heads, width, dh),
                torch.zeros(2, 1, 1, width), torch.zeros(batch, 1, length, own))

        def f(q, k, v, pk, pv, prefix, mine):
            return split_prefix_attention(q, k, v, (pk, pv), SplitMasks(prefix, mine, "triton")) * 2

        compiled = torch.compile(f, backend="aot_eager", fullgraph=True, dynamic=True)
        print(float((compiled(*args) - f(*args)).abs().max()))
        head0 = (torch.randn(batch, length, dh), torch.randn(batch, own, dh))  # the rotary operator

        def g(q, k, v, pk, pv, prefix, mine, q0, k0):
            return split_prefix_attention(q, k, v, (pk, pv), SplitMasks(prefix, mine, "triton", True), (q0, k0)) * 2

        compiled = torch.compile(g, backend="aot_eager", fullgraph=True, dynamic=True)
        print(float((compiled(*args, *head0) - g(*args, *head0)).abs().max()))
    """)
    assert [float(x) for x in out.strip().splitlines()[-2:]] == [0.0, 0.0]


@pytest.mark.parametrize("rotary", [False, True])
def test_a_one_voice_batch_decodes_the_same_mel_with_the_kernel(rotary: bool) -> None:
    """The tiny flow's decode of a one-voice batch from the prompt cache, its attention split
    at the prompt in every block: with the kernel (`rotary`: head 0 rotated apart) the
    mel frames are those of the torch formula (float32, to rounding), and its operator ran."""
    op = "split_prefix_attention_rotary" if rotary else "split_prefix_attention"
    out = run_interpreted(f"""
        import torch
        from engine.flow_prompt_cache import PromptCache, decode_with_prompt_cache
        from engine.models.config import ModelConfig
        from engine.models.flow import CausalMaskedDiffWithDiT
        from engine.models.flow import init_random_
        from tests.test_flow_prompt_cache import chunk, make_voice
        torch.set_num_threads(1)
        model = init_random_(CausalMaskedDiffWithDiT(ModelConfig.tiny().flow), seed=4321).eval()
        a = make_voice(60, 1)
        chunks = [chunk(a, 0, 10, False), chunk(a, 0, 12, True)]
        entries = PromptCache().entries_for(model, chunks)
        dit = model.decoder.estimator
        dit.split_prefix_rows = 1
        mels, calls = {{}}, []
        kernel_op = torch.ops.cosyvoice.{op}
        torch.ops.cosyvoice.{op} = lambda *args: calls.append(1) or kernel_op(*args)
        for kernel, rotary in (("cudnn", False), ("triton", {rotary})):
            dit.use_attention_kernel(kernel, rotary=rotary)
            mels[kernel], _ = decode_with_prompt_cache(model, chunks, entries)
        print(len(calls))
        diffs = [float((a - b).abs().max()) for a, b in zip(mels["cudnn"], mels["triton"])]
        print(max(diffs) if all(d == d for d in diffs) else "nan")  # max() would pass a NaN over
    """)
    calls, worst = out.strip().splitlines()[-2:]
    assert int(calls) > 0 and float(worst) < 1e-4  # the kernel ran, in every block and step


def test_the_launch_sweep_holds_the_shipped_setting() -> None:
    """`bench.split_attention_tune` times the shipped launch setting among the others (its
    table's baseline), and says so, without a traceback, where there is no GPU."""
    from bench import split_attention_tune as tune

    assert split_attention_kernel.LAUNCH in tune.sweep(quick=False)
    assert tune.sweep(quick=True)[0] == split_attention_kernel.LAUNCH
    assert len(set(tune.sweep(quick=False))) == len(tune.sweep(quick=False)) == 22
    tiles = tune.sweep(quick=False, tiles=True)
    assert len(set(tiles)) == len(tiles) == 38 and set(tune.sweep(quick=False)) < set(tiles)
    assert {c.block_m for c in tiles} == {16, 32, 64, 128}
    assert tune.main(["--kernels", "shipped,nope"]) == 2  # a wrong name, on any machine
    t = torch.randn(2, 3, 5, 16)
    view = tune.projected(t)  # `--rotary`: as the DiT passes q, k and v
    assert torch.equal(view, t) and view.stride() == (5 * 3 * 48, 16, 3 * 48, 1)
    blank = tune.projected(t, blank_head0=True)  # q and k: head 0 only from `head0`
    assert torch.equal(blank[:, 1:], t[:, 1:]) and not blank[:, 0].any()
    if not torch.cuda.is_available():
        assert tune.main([]) == 2


def test_the_kernel_takes_head_0_apart_as_the_dit_passes_it() -> None:
    """With `head0` the kernel reads head 0's queries and own keys from there and the other
    heads' from q and k, here the projection's strided views, unrotated: the same attention
    as `dit.apply_rotary` on the projection and the kernel without `head0`, under the shipped
    launch settings and others, with as many own keys as queries or more; heads past 0
    untouched. And the trial with head 0 apart."""
    out = run_interpreted("""
        import torch
        from engine.models import split_attention_kernel as sak
        from engine.models.dit import (RotaryEmbedding, SplitMasks, apply_rotary, attention_bias, rotated_channels,
                                       split_prefix_attention)
        torch.manual_seed(0)
        worst, moved = 0.0, 0.0
        for rows, heads, length, own, width, dh in ((1, 2, 5, 5, 3, 16), (2, 3, 70, 70, 90, 32),
                                                    (3, 2, 64, 64, 64, 16), (1, 3, 9, 20, 7, 16)):
            batch = 2 * rows
            q = torch.randn(batch, length, 3 * heads * dh).split(heads * dh, dim=-1)[0]
            _, k, v = torch.randn(batch, own, 3 * heads * dh).split(heads * dh, dim=-1)  # [B, S, H x dh] views
            positions = torch.randint(0, 400, (batch,))[:, None] + torch.arange(own)
            angles = RotaryEmbedding(dh).at(positions)
            rope_q, rope_k = (angles[:, -length:].cos(), angles[:, -length:].sin()), (angles.cos(), angles.sin())
            pk, pv = torch.randn(2, heads, width, dh), torch.randn(2, heads, width, dh)
            seen = torch.rand(2, 1, 1, width) > 0.2
            mine = torch.rand(batch, 1, length, own) > 0.3
            masks = SplitMasks(attention_bias(seen, torch.float32), attention_bias(mine, torch.float32), "triton")
            heads_of = lambda t: t.view(batch, t.shape[1], heads, dh).transpose(1, 2)
            want = split_prefix_attention(heads_of(apply_rotary(q, *rope_q)), heads_of(apply_rotary(k, *rope_k)),
                                          heads_of(v), (pk, pv), masks)
            head0 = (rotated_channels(q, *rope_q), rotated_channels(k, *rope_k))
            # As views with other row and batch strides than dh (and, for the keys, a last
            # stride of 2, which the launch makes contiguous): read at their own strides.
            spaced_q = torch.zeros(batch, 2 * length, dh + 16)
            spaced_q[:, ::2, :dh] = head0[0]
            spaced_k = torch.zeros(batch, own, 2 * dh)
            spaced_k[..., ::2] = head0[1]
            views = (spaced_q[:, ::2, :dh], spaced_k[..., ::2])
            assert views[0].stride()[1:] == (2 * (dh + 16), 1) and views[1].stride(-1) == 2
            got = sak.launch(heads_of(q), heads_of(k), heads_of(v), pk, pv, masks.prefix, masks.own, sak.LAUNCH,
                             head0=views)
            worst = max(worst, float((got - want).abs().max()))
            for config in (sak.LAUNCH, sak.LaunchConfig(16, 32, 4, 2)):
                got = sak.launch(heads_of(q), heads_of(k), heads_of(v), pk, pv, masks.prefix, masks.own, config,
                                 head0=head0)
                worst = max(worst, float((got - want).abs().max()))
            got = split_prefix_attention(heads_of(q), heads_of(k), heads_of(v), (pk, pv), masks, head0)
            worst = max(worst, float((got - want).abs().max()))
            unrotated = split_prefix_attention(heads_of(q), heads_of(k), heads_of(v), (pk, pv), masks)
            moved = max(moved, float((unrotated - want)[..., :dh].abs().max()))
            assert torch.equal(unrotated[..., dh:], want[..., dh:])  # only head 0 is rotated
        print(sak._trial(torch.device("cpu"), torch.float32, True))
        print(worst, moved)
    """)
    trial, numbers = out.strip().splitlines()[-2:]
    worst, moved = map(float, numbers.split())
    assert trial == "True" and worst < 1e-5 and moved > 1e-2  # the rotation changes head 0's attention


def test_head_0_apart_is_checked() -> None:
    """Only the triton kernel takes head 0 apart (masks, the DiT's setting), and its queries
    and own keys must be [B, T, dh] and [B, S, dh] of q's dtype: a clear error, not a wrong
    read."""
    from engine.models.config import ModelConfig
    from engine.models.dit import split_prefix_masks
    from engine.models.flow import CausalMaskedDiffWithDiT

    mask = torch.ones(4, 1, 3, 10, dtype=torch.bool)
    assert split_prefix_masks(mask, 5, torch.float32, "triton", True).rotary
    with pytest.raises(ValueError, match="only the triton kernel"):
        split_prefix_masks(mask, 5, torch.float32, "cudnn", True)
    dit = CausalMaskedDiffWithDiT(ModelConfig.tiny().flow).decoder.estimator
    with pytest.raises(ValueError, match="only the triton kernel"):
        dit.use_attention_kernel("cudnn", rotary=True)
    dit.use_attention_kernel("triton", rotary=True)
    assert dit.rotary_in_attention
    batch, heads, length, own, width, dh = 4, 2, 3, 5, 5, 16
    q, k = torch.randn(batch, heads, length, dh), torch.randn(batch, heads, own, dh)
    pk = torch.randn(2, heads, width, dh)
    biases = (torch.zeros(2, 1, 1, width), torch.zeros(batch, 1, length, own))
    q0, k0 = torch.randn(batch, length, dh), torch.randn(batch, own, dh)
    cases = (((k0, k0), r"must be \[4, 3, 16\] and \[4, 5, 16\]"),
             ((q0, q0), r"must be \[4, 3, 16\] and \[4, 5, 16\]"),
             ((q0[..., :8], k0), r"not \(4, 3, 8\) and"),
             ((q0.double(), k0), "of q's dtype"))
    for head0, what in cases:
        with pytest.raises(ValueError, match=what):
            split_attention_kernel.launch(q, k, k, pk, pk, *biases, split_attention_kernel.LAUNCH,
                                          kernel=object(), head0=head0)


def test_the_stage_turns_the_rotary_setting_off_where_the_kernel_does_not_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """`flow_attention_rotary` (on by default) reaches the DiT only with the triton kernel in
    use: off the interpreter the CPU takes cuDNN's calls, and rotates as before, as it does
    with the setting on and cuDNN's calls asked for."""
    from engine.models.config import ModelConfig
    from engine.models.flow import CausalMaskedDiffWithDiT
    from engine.token2wav import AudioStage

    assert EngineConfig(model_dir=Path(".")).flow_attention_rotary is True
    assert EngineConfig(model_dir=Path("."), flow_attention="cudnn", flow_attention_rotary=True).flow_attention_rotary
    flow = CausalMaskedDiffWithDiT(ModelConfig.tiny().flow)
    AudioStage(flow, torch.nn.Linear(1, 1), torch.device("cpu"), flow_attention="cudnn", flow_attention_rotary=True)
    assert (flow.decoder.estimator.attention_kernel, flow.decoder.estimator.rotary_in_attention) == ("cudnn", False)
    AudioStage(flow, torch.nn.Linear(1, 1), torch.device("cpu"), flow_attention="triton", flow_attention_rotary=True)
    dit = flow.decoder.estimator
    interpreting = os.environ.get("TRITON_INTERPRET") == "1"
    assert (dit.attention_kernel, dit.rotary_in_attention) == (("triton", True) if interpreting else ("cudnn", False))
    # Where the kernel runs (as on a GPU), the rotary variant's own trial decides.
    for rotary_runs in (True, False):
        monkeypatch.setattr(split_attention_kernel, "runs_on", lambda d, t, rotary=False: rotary_runs or not rotary)
        AudioStage(flow, torch.nn.Linear(1, 1), torch.device("cpu"), flow_attention="triton", flow_attention_rotary=True)
        assert (dit.attention_kernel, dit.rotary_in_attention) == ("triton", rotary_runs)
        AudioStage(flow, torch.nn.Linear(1, 1), torch.device("cpu"), flow_attention="triton",
                   flow_attention_rotary=False)
        assert (dit.attention_kernel, dit.rotary_in_attention) == ("triton", False)


def test_a_trial_that_disagrees_says_so_and_keeps_the_kernel_out(monkeypatch: pytest.MonkeyPatch,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    """A kernel that runs but computes something else is not taken, with a warning that says
    by how much it missed (the README's promise), for either variant of the trial."""
    import logging

    monkeypatch.setattr(split_attention_kernel, "split_prefix_attention",
                        lambda q, *args: torch.zeros(q.shape[0], q.shape[2], q.shape[1] * q.shape[3]))
    with caplog.at_level(logging.WARNING, logger=split_attention_kernel.__name__):
        for rotary in (False, True):
            assert split_attention_kernel._trial.__wrapped__(torch.device("cpu"), torch.float32, rotary) is False
    assert [r.getMessage().split(" disagrees")[0] for r in caplog.records] == [
        "the split attention kernel", "the split attention kernel with head 0 apart"]


def test_the_dit_rotates_q_and_k_itself_where_the_kernel_cannot() -> None:
    """`Attention.forward` takes head 0 apart for the kernel only in calls that attend to this
    call's keys alone and keep none: with a ring of context keys before them, or the keys
    kept (`keep_kv`, the context cache's rings; a recorded call takes no split masks), the
    keys must be the rotated ones. Every such call gives what the unfused one gives, kept
    keys included."""
    out = run_interpreted("""
        import torch
        from engine.models.dit import Attention, SplitMasks, RotaryEmbedding, attention_bias
        torch.manual_seed(0)
        rotary_op, strides = torch.ops.cosyvoice.split_prefix_attention_rotary, []
        torch.ops.cosyvoice.split_prefix_attention_rotary = lambda q, k, *rest: (
            strides.append((q.stride(2), k.stride(2))) or rotary_op(q, k, *rest))
        batch, heads, length, width, ring, dh = 4, 2, 6, 5, 3, 16
        attn = Attention(24, heads, dh)
        x = torch.randn(batch, length, 24)
        angles = RotaryEmbedding(dh).at(torch.arange(length) + 40 * torch.arange(batch)[:, None])
        rope = (angles.cos(), angles.sin())
        prefix_kv = (torch.randn(2, heads, width, dh), torch.randn(2, heads, width, dh))
        ring_kv = (torch.randn(batch, heads, ring, dh), torch.randn(batch, heads, ring, dh))
        pad = torch.ones(batch, length, dtype=torch.bool)
        worst = 0.0
        for ring_in, keep in ((None, False), (None, True), (ring_kv, False)):
            own = length + (0 if ring_in is None else ring)
            masks = SplitMasks(attention_bias(torch.rand(2, 1, 1, width) > 0.2, torch.float32),
                               attention_bias(torch.rand(batch, 1, length, own) > 0.3, torch.float32), "triton")
            got = attn(x, masks._replace(rotary=True), pad, rope, prefix_kv, shared=True, ring_kv=ring_in, keep_kv=keep)
            want = attn(x, masks, pad, rope, prefix_kv, shared=True, ring_kv=ring_in, keep_kv=keep)
            for a, b in zip(got if keep else (got,), want if keep else (want,)):
                worst = max(worst, float((a - b).abs().max()))
        print(strides)
        print(worst)
    """)
    strides, worst = out.strip().splitlines()[-2:]
    # Only the call with no ring and nothing kept took head 0 apart, q and k as the projection
    # left them (a frame's row: q, k and v of all heads), not a rotated copy.
    assert strides == "[(96, 96)]" and float(worst) < 1e-5


def test_the_kernel_compiles_to_pipelined_hopper_machine_code() -> None:
    """The interpreter runs the kernel's arithmetic, not Triton's compiler: here the kernel
    goes through every stage down to an sm_90 binary (ptxas ships with Triton; no GPU
    needed), both variants, with the shipped launch settings and the 16-byte alignments a
    launch on the DiT's tensors gives, so a kernel only a GPU would refuse is caught before
    a GPU session's A/B is spent finding out. Both stage their key and value blocks in
    shared memory ahead of the step that uses them (pipelined) and take the same shared
    memory: head 0 apart is a choice of pointers, not a branch in the loop (round 46: one
    that made every program copy each key block to registers and back, or a second loop
    that doubled the shared memory, slowed the stage)."""
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = split_attention_kernel._triton()
    assert kernel is not None
    launch = split_attention_kernel.LAUNCH
    unspecialised = {"length", "own", "width", "rows", "sob_b", "sob_t", "scale"}
    binaries = []
    for rotary in (False, True):
        constants = {"DH": 64, "BM": launch.block_m, "BN": launch.block_n, "PRECISION": "tf32", "ROTARY": rotary}
        signature = {name: ("constexpr" if name in constants else "fp32" if name == "scale"
                            else "*bf16" if name.endswith("_ptr") else "i32") for name in kernel.arg_names}
        aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(kernel.arg_names)
                   if name not in constants and name not in unspecialised}
        source = ASTSource(fn=kernel, signature=signature, attrs=aligned,
                           constexprs={(kernel.arg_names.index(k),): v for k, v in constants.items()})
        binaries.append(triton.compile(source, target=GPUTarget("cuda", 90, 32),
                                       options={"num_warps": launch.num_warps, "num_stages": launch.num_stages}))
    for rotary, binary in zip((False, True), binaries):
        ttgir = binary.asm["ttgir"]
        assert binary.asm["cubin"] and "warp_group_dot" in ttgir  # Hopper's matrix instructions
        assert ttgir.count("async_copy_global_to_local") >= 4  # keys and values, both loops, ahead
        branches = re.findall(r"scf\.if %\w+ -> \(([^)]*)\)", ttgir)
        assert len(branches) == rotary and all(set(re.findall(r"!tt\.ptr<bf16>|tensor", b)) == {"!tt.ptr<bf16>"}
                                               for b in branches)  # head 0 apart: a choice of two pointers
    assert binaries[0].metadata.shared == binaries[1].metadata.shared
