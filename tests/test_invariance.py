"""Batch-invariant verification in low precision (accel.kernels.invariance): the probe's logic on
fake kernels, the aligned cache, and greedy exactness of drafting in bfloat16."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import accel
from accel import adapter
from accel.kernels import invariance
from accel.cache import SharedCache
from accel.calibration.cost_model import CostTable, allocate_drafts
from accel.engine import Batch
from accel.steps import prefill, verify_logits
from accel.strategy import DraftProposal
from accel.tree import DraftTree
from helpers import TINY_VOCAB, Scripted, left_padded, make_tiny_model, repetitive_prompt
from speculative import PromptLookup


#: The default model's attention shape (head_dim 64, 3 query heads per KV head) at a tiny
#: width: on the Intel Xeon (Ice Lake) machine its bf16 verify needs both the row padding and
#: the aligned columns to be invariant, so the tests below fail without either.
_SHAPE = dict(hidden_size=192, num_attention_heads=3, num_kv_heads=1, intermediate_size=512)


def _bf16(seed: int = 3):
    return make_tiny_model(seed=seed, **_SHAPE).to(torch.bfloat16)


def _row_count_kernel(model, delta):
    """Make the output layer's result depend on how many rows it gets, like a CPU kernel
    that picks its summation order by row count: logits + delta(rows)."""

    def hook(module, args, out):
        rows = args[0].reshape(-1, args[0].shape[-1]).shape[0]
        return out + delta(rows)

    model.get_output_embeddings().register_forward_hook(hook)
    return model


def test_float32_runs_unpadded_and_unaligned():
    model = make_tiny_model()
    assert invariance.verify_rows(model) == 1 and invariance.kv_align(model) == 1
    batch = Batch(model)
    assert batch.min_nodes == 1 and batch.cache.kv_align == 1


pytestmark = pytest.mark.filterwarnings("ignore:accel. .* verification of .* is approximate:RuntimeWarning")


def test_probe_picks_the_row_count_past_a_kernels_threshold():
    base = _bf16()
    r0 = invariance.verify_rows(copy.deepcopy(base))  # what the real kernels need here
    # below 8 rows the fake kernel sums in "another order"
    fake = _row_count_kernel(copy.deepcopy(base), lambda rows: 0.0625 if rows < 8 else 0.0)
    assert not invariance.probe(fake, 4)
    assert invariance.verify_rows(fake) == max(r0, 8)


@pytest.mark.filterwarnings("default")
def test_low_precision_is_labelled_approximate():
    fake = _row_count_kernel(_bf16(), lambda rows: 0.0625 * rows)  # every row count differs
    with pytest.warns(RuntimeWarning, match="none of .* gave bit-identical logits"):
        rows = invariance.verify_rows(fake)
    assert rows == 1 and not invariance.is_exact(fake)
    model = _bf16()
    with pytest.MonkeyPatch.context() as mp:  # where this machine's products fail ordered attention's probe
        mp.setattr(invariance, "_ordered_probe", lambda head_dim, groups: False)
        with pytest.warns(RuntimeWarning, match="passed the invariance probe"):
            invariance.verify_rows(model)
        assert not invariance.ordered(model) and not invariance.is_exact(model)
    assert invariance.is_exact(make_tiny_model())
    ids = repetitive_prompt(2, 30)
    out = accel.generate(fake, ids, strategies=[PromptLookup()], max_new_tokens=8, eos_token_id=[])
    assert not out.stats.exact_verify and "approximate" in out.stats.summary()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once per model, not per call
        invariance.verify_rows(fake)


def test_aligned_cache_shows_masked_columns_to_a_multiple():
    model = make_tiny_model(seed=5)
    geo = adapter.geometry(model)
    ids = repetitive_prompt(4, 37)
    tree = DraftTree.from_proposal(9, DraftProposal(torch.tensor([4, 5, 6, 7]), torch.tensor([0, 1, 0, 2])))
    out = {}
    for align in (1, 16):
        cache = SharedCache(geo.num_layers)
        cache.kv_align = align
        with torch.inference_mode():
            prefill(model, cache, ids)
            _, logits = verify_logits(model, cache, [tree], geo.dtype, geo.num_heads // geo.num_kv_heads)
            k, _ = cache._store(0, *(torch.zeros(1, geo.num_kv_heads, 1, geo.head_dim),) * 2)
        out[align] = logits
        assert k.shape[2] % align == 0 and k.shape[2] >= 37 + 5 + 1
    assert torch.allclose(out[1], out[16], atol=1e-5)  # the extra columns are masked out


def test_allocator_counts_padding_as_free():
    # a verify pass costs 10 ms + 1 ms per token; every row is padded to 4 tokens anyway
    table = CostTable(tokens=(1, 64), cache_lens=(0, 4096), ms=((11.0, 74.0), (11.0, 74.0)))
    weak = [[0.05] * 8]  # drafts that rarely pay
    assert allocate_drafts(table, 100, weak, 8) == [0]
    assert allocate_drafts(table, 100, weak, 8, min_nodes=4) == [3]  # the padding's slots are free
    with pytest.raises(ValueError, match="min_nodes"):
        allocate_drafts(table, 100, weak, 8, min_nodes=0)


def test_bf16_batch_is_ordered_and_padded(monkeypatch):
    model = _bf16()
    batch = Batch(model)
    assert batch.cache.ordered and batch.cache.kv_align == 1 and batch.exact
    # the batch pads to the row count the probe found invariant, and at that count the probe passes
    assert batch.min_nodes == invariance.verify_rows(model)
    assert invariance.probe(model, batch.min_nodes, batch.cache.kv_align)
    monkeypatch.setattr(invariance, "_ordered_probe", lambda head_dim, groups: False)
    batch = Batch(_bf16())  # without ordered attention: sdpa on aligned columns, approximate
    assert not batch.cache.ordered and batch.cache.kv_align == invariance.KV_ALIGN and not batch.exact


@pytest.mark.parametrize("mode", ["random", "right_then_wrong", "prompt_lookup"])
def test_bf16_greedy_drafting_equals_plain_bf16_decoding(mode):
    # the same call with and without drafts (a batched prefill in bf16 is its own arithmetic:
    # rows are compared with plain decoding of the same batch)
    model = _bf16(seed=11)
    prompts = [repetitive_prompt(s, n)[0] for s, n in ((1, 48), (2, 23), (3, 61))]
    if mode == "prompt_lookup":
        calls = [(left_padded(prompts), [PromptLookup()])]
    else:  # Scripted drafts against each row's own reference, one row per call
        calls = []
        for p in prompts:
            ref = accel.generate(model, p[None], strategies=[], max_new_tokens=24, eos_token_id=[]).sequences[0]
            calls.append(((p[None], None), [Scripted(mode=mode, reference=tuple(ref.tolist()))]))
    for (ids, mask), strategies in calls:
        kw = dict(attention_mask=mask, max_new_tokens=24, eos_token_id=[])
        ref = accel.generate(model, ids, strategies=[], **kw)
        out = accel.generate(model, ids, strategies=strategies, **kw)
        # ordered attention: claimed exact, and equal (these models differ on sdpa without the padding)
        assert out.stats.exact_verify and out.stats.drafted_tokens > 0
        assert all(torch.equal(g, r) for g, r in zip(out.sequences, ref.sequences))


@pytest.mark.parametrize("gather", [0, 10**9])
def test_bf16_logits_of_any_tree_equal_plain_steps_bit_for_bit(gather, monkeypatch):
    # independent of the probe's own shapes: other prompt lengths, a wide tree, three rows;
    # committed blocks read in place (gather=0) and every query's keys gathered
    from accel.kernels import ordered

    monkeypatch.setattr(ordered, "GATHER", gather)
    model = _bf16(seed=7)
    geo = adapter.geometry(model)
    rows = invariance.verify_rows(model)
    groups = geo.num_heads // geo.num_kv_heads
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(2, TINY_VOCAB, (n,), generator=gen) for n in (60, 41, 13)]

    def cache_of(ps):  # rows prefilled one by one and joined, as accel.Engine admits them
        cache = SharedCache(geo.num_layers)
        cache.ordered = invariance.ordered(model)
        for p in ps:
            one = SharedCache(geo.num_layers)
            prefill(model, one, p.unsqueeze(0))
            cache.extend(one)
        return cache

    with torch.inference_mode(), adapter.packed_gqa_attention(model):
        cache = cache_of([prompts[0]])
        toks, plain = [5], []
        for _ in range(7):
            _, logits = verify_logits(model, cache, [DraftTree.root_only(toks[-1])], geo.dtype, groups, rows)
            plain.append(logits[0])
            toks.append(int(logits[0].argmax()))
            cache.commit([[0]])
        extra = torch.randint(2, TINY_VOCAB, (9,), generator=gen)
        tree = DraftTree.from_proposal(toks[0], DraftProposal(
            torch.cat([torch.tensor(toks[1:7]), extra]), torch.tensor(list(range(6)) + [0, 1, 2, 2, 3, 0, 4, 5, 1])))
        others = [DraftTree.chain(3, extra[:4].tolist()), DraftTree.root_only(8)]
        _, logits = verify_logits(model, cache_of(prompts), [tree, *others], geo.dtype, groups, rows)
    assert all(torch.equal(logits[i], plain[i]) for i in range(7))


def test_cli_generate_loads_the_dtype_asked_for(monkeypatch, capsys):
    import accel.models
    from accel.cli import main
    from accel.dtypes import as_dtype
    from helpers import make_tiny_tokenizer

    seen = []

    def fake_load(name, dtype=torch.float32, **kw):  # (the CLI passes a dtype name)
        seen.append(as_dtype(dtype))
        return make_tiny_model(seed=2).to(as_dtype(dtype)), make_tiny_tokenizer()

    monkeypatch.setattr(accel.models, "load_model", fake_load)
    assert main(["generate", "--dtype", "bfloat16", "--max-new-tokens", "4", "--strategy", "prompt_lookup",
                 "hello world"]) == 0
    assert seen == [torch.bfloat16] and "accepted/step" in capsys.readouterr().err
