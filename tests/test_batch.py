"""The batched engine: every row of a batch decodes exactly as it would alone."""

from __future__ import annotations

import pytest
import torch

import accel
from helpers import TINY_VOCAB, Scripted, alone_tokens, left_padded, make_tiny_model, repetitive_prompt
from snapkv import AdaSnapKV, SnapKV
from speculative import Medusa, PromptLookup

LENGTHS = (37, 52, 20, 45, 60, 29, 41, 33)


def _prompts(count: int, seed: int = 0) -> list[torch.Tensor]:
    """Repetitive prompts [n] of different lengths (so prompt lookup drafts)."""
    return [repetitive_prompt(seed + i, LENGTHS[i % len(LENGTHS)])[0] for i in range(count)]


def _batched(model, prompts, strategies, new, **kw) -> tuple[list[list[int]], accel.GenerateResult]:
    ids, mask = left_padded(prompts)
    res = accel.generate(model, ids, attention_mask=mask, strategies=strategies, max_new_tokens=new, **kw)
    width = ids.shape[1]
    rows = []
    for i, s in enumerate(res.row_stats):
        rows.append(res.sequences[i, width: width + s.new_tokens].tolist())
    return rows, res


COMBOS = {
    "plain": lambda h: [],
    "snapkv": lambda h: [SnapKV(budget=16, window=4, kernel=3)],
    "ada": lambda h: [AdaSnapKV(budget=16, window=4, kernel=3)],
    "lookup": lambda h: [PromptLookup()],
    "medusa": lambda h: [Medusa(heads=h, max_nodes=8)],
    "snapkv+lookup": lambda h: [SnapKV(budget=16, window=4, kernel=3), PromptLookup()],
    "ada+lookup+medusa": lambda h: [AdaSnapKV(budget=20, window=4, kernel=3), PromptLookup(), Medusa(heads=h)],
}


@pytest.mark.parametrize("combo", list(COMBOS))
def test_every_row_equals_that_row_alone(combo, heads_dir):
    model = make_tiny_model(seed=31)
    prompts = _prompts(5, seed=10)
    strategies = COMBOS[combo](heads_dir)
    rows, res = _batched(model, prompts, strategies, 24, eos_token_id=[])
    for p, row in zip(prompts, rows):
        assert row == alone_tokens(model, p, 24, strategies)
    assert res.stats.new_tokens == 5 * 24
    if "medusa" in combo:  # random heads: drafts are proposed (and rejected)
        assert res.stats.drafted_tokens > 0
    if "lookup" in combo and "medusa" not in combo:  # (random heads drive a row's acceptance estimate down)
        assert res.stats.drafted_tokens > 0 and res.stats.accepted_tokens > 0
        # rows accept different numbers of tokens: ragged acceptance happened
        assert len({s.verify_steps for s in res.row_stats}) > 1


@pytest.mark.parametrize("size", [1, 2, 3, 8])
def test_batch_sizes_one_to_eight(size):
    model = make_tiny_model(seed=32)
    prompts = _prompts(size, seed=20)
    for strategies in ([], [PromptLookup()]):
        rows, res = _batched(model, prompts, strategies, 16, eos_token_id=[])
        assert rows == [alone_tokens(model, p, 16, strategies) for p in prompts]
        assert len(res.row_stats) == size


def test_plain_batch_equals_model_generate_with_left_padding():
    model = make_tiny_model(seed=33)
    prompts = _prompts(4, seed=30)
    ids, mask = left_padded(prompts)
    ref = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=12, pad_token_id=0,
                         eos_token_id=None)
    res = accel.generate(model, ids, attention_mask=mask, max_new_tokens=12, eos_token_id=[])
    assert torch.equal(res.sequences, ref)


def test_rows_that_stop_early_leave_the_others_exact():
    model = make_tiny_model(seed=34)
    prompts = _prompts(4, seed=40)
    free = [alone_tokens(model, p, 20) for p in prompts]
    stop = free[1][3]  # row 1 stops at its 4th token (others may stop too, wherever it occurs)
    rows, res = _batched(model, prompts, [PromptLookup()], 20, eos_token_id=stop)
    for p, row, alone in zip(prompts, rows, free):
        expect = alone[: alone.index(stop) + 1] if stop in alone else alone
        assert row == expect
    assert len(rows[1]) == 4 and res.row_stats[1].new_tokens == 4


def test_garbage_drafter_and_rows_without_drafts_stay_exact():
    model = make_tiny_model(seed=35)
    prompts = _prompts(4, seed=50)
    ref = [alone_tokens(model, p, 20) for p in prompts]
    for mode in ("random", "empty"):
        rows, res = _batched(model, prompts, [Scripted(mode=mode)], 20, eos_token_id=[])
        assert rows == ref
        assert (res.stats.drafted_tokens > 0) == (mode == "random")


def test_sampling_is_reproducible_and_per_row():
    model = make_tiny_model(seed=36)
    prompts = _prompts(3, seed=60)
    kw = dict(temperature=1.0, seed=7, eos_token_id=[])
    a, _ = _batched(model, prompts, [PromptLookup()], 16, **kw)
    b, _ = _batched(model, prompts, [PromptLookup()], 16, **kw)
    assert a == b
    # row i samples with seed + i: what it samples alone with that seed
    for i, (p, row) in enumerate(zip(prompts, a)):
        assert row == alone_tokens(model, p, 16, [PromptLookup()], temperature=1.0, seed=7 + i)
    assert a != _batched(model, prompts, [PromptLookup()], 16, temperature=1.0, seed=8, eos_token_id=[])[0]


def test_stream_yields_each_rows_tokens_as_accepted():
    model = make_tiny_model(seed=37)
    prompts = _prompts(3, seed=70)
    ids, mask = left_padded(prompts)
    got: dict[int, list[int]] = {0: [], 1: [], 2: []}
    finished = set()
    for delta in accel.stream(model, ids, attention_mask=mask, strategies=[PromptLookup()], max_new_tokens=15,
                              eos_token_id=[]):
        assert delta.row not in finished
        got[delta.row].extend(delta.tokens)
        if delta.finished:
            finished.add(delta.row)
            assert delta.finish_reason == "length"
    assert finished == {0, 1, 2}
    assert [got[i] for i in range(3)] == [alone_tokens(model, p, 15) for p in prompts]


def test_stats_are_aggregate_and_per_row():
    model = make_tiny_model(seed=38)
    prompts = _prompts(3, seed=80)
    rows, res = _batched(model, prompts, [SnapKV(budget=16, window=4, kernel=3)], 10, eos_token_id=[])
    assert res.stats.new_tokens == sum(s.new_tokens for s in res.row_stats) == 30
    assert res.stats.kv_bytes_kept == sum(s.kv_bytes_kept for s in res.row_stats)
    per_token = 2 * 2 * 2 * 16 * 4
    for p, s in zip(prompts, res.row_stats):
        assert s.prompt_tokens == p.numel()
        assert s.kv_bytes_kept == (16 + 9) * per_token  # budget + the 9 fed-back tokens
        assert s.kv_bytes_full == (p.numel() + 9) * per_token
        assert 0 < s.first_token_s <= s.latency_s
    assert res.stats.decode_s > 0 and res.stats.prefill_s > 0


def test_context_length_is_checked():
    model = make_tiny_model(seed=39, max_position_embeddings=64)
    with pytest.raises(ValueError, match="context of 64"):
        accel.generate(model, torch.arange(2, 50).unsqueeze(0), max_new_tokens=20)


@pytest.mark.parametrize("kwargs,match", [
    (dict(max_new_tokens=True), "max_new_tokens"),
    (dict(attention_mask=torch.ones(1, 3, dtype=torch.long)), "attention_mask"),
])
def test_bad_arguments_are_named(kwargs, match):
    model = make_tiny_model()
    with pytest.raises(ValueError, match=match):
        accel.generate(model, torch.tensor([[3, 4]]), **kwargs)


def test_the_guard_decides_whether_a_measured_batch_drafts(monkeypatch):
    from accel.calibration import calibrate
    from accel.calibration.cost_model import CostTable, DraftGuard

    model = make_tiny_model(seed=36)
    prompts = _prompts(3, seed=60)
    ref = [alone_tokens(model, p, 16) for p in prompts]
    flat = CostTable(tokens=(1, 64), cache_lens=(256,), ms=((10.0, 10.5),))  # measured: drafting looks free
    monkeypatch.setattr(calibrate, "cost_table", lambda model: flat)
    seen: list[tuple[bool, float]] = []
    monkeypatch.setattr(DraftGuard, "observe", lambda self, drafted, speed: seen.append((drafted, speed)))
    for allow in (True, False):
        monkeypatch.setattr(DraftGuard, "allow", lambda self: allow)
        seen.clear()
        rows, res = _batched(model, prompts, [PromptLookup()], 16, eos_token_id=[])
        assert rows == ref
        assert (res.stats.drafted_tokens > 0) == allow
        assert seen and all(drafted <= allow for drafted, _ in seen) and all(speed > 0 for _, speed in seen)
        assert any(drafted for drafted, _ in seen) == allow


def test_each_batch_size_keeps_its_guard_across_calls(monkeypatch):
    from accel.calibration import calibrate
    from accel import engine
    from accel.calibration.cost_model import CostTable

    model = make_tiny_model(seed=37)
    flat = CostTable(tokens=(1, 64), cache_lens=(256,), ms=((10.0, 10.5),))  # measured: the guard is live
    monkeypatch.setattr(calibrate, "cost_table", lambda model: flat)
    prompts = _prompts(3, seed=61)
    ref = [alone_tokens(model, p, 12) for p in prompts]
    _batched(model, prompts, [PromptLookup()], 12, eos_token_id=[])
    guards = engine._GUARDS[model]
    (key,) = [k for k in guards if k[0] == 4]  # 3 rows: the batches of 3-4, and the drafter's settings
    assert len(key[1]) == 1 and key[1][0].startswith("prompt_lookup{")
    guards[key].muted = 10_000  # this batch size learned that drafting does not pay
    rows, res = _batched(model, prompts, [PromptLookup()], 12, eos_token_id=[])
    assert rows == ref and res.stats.drafted_tokens == 0
    other, res = _batched(model, prompts, [PromptLookup(num_tokens=7)], 12, eos_token_id=[])
    assert other == ref and res.stats.drafted_tokens > 0  # other settings: a guard of their own
    guards.setdefault((1, key[1]), engine.DraftGuard()).muted = 0
    one = accel.generate(model, prompts[0].unsqueeze(0), strategies=[PromptLookup()], max_new_tokens=12, eos_token_id=[])
    assert one.stats.drafted_tokens > 0  # a batch of one has its own guard


def test_guards_tell_drafters_apart_even_without_a_json_form():
    """A drafter field with no JSON form (a tensor) must not break the guard's key: such a
    drafter is told apart by identity, equal settings share one key."""
    from pydantic import ConfigDict

    from accel.engine import plan_strategies

    class Tensorial(accel.Drafter):
        model_config = ConfigDict(arbitrary_types_allowed=True, frozen=True)
        name = "tensorial_test"
        bias: torch.Tensor

        def propose(self, state, ctx):
            return None

    a, b = Tensorial(bias=torch.ones(2)), Tensorial(bias=torch.ones(2))
    (sa,), (sb,) = plan_strategies([a]).drafter_specs, plan_strategies([b]).drafter_specs
    assert sa.startswith("tensorial_test<") and sa != sb
    assert plan_strategies([PromptLookup()]).drafter_specs == plan_strategies([PromptLookup()]).drafter_specs


def test_drafters_whose_settings_cannot_be_compared_draft_row_by_row():
    """Rows are grouped by equal drafters; a field without a truth value (a tensor) must not
    break the grouping: such rows draft alone, and stay exact."""
    from pydantic import ConfigDict

    from accel.strategy import DraftProposal

    class Biased(accel.Drafter):
        model_config = ConfigDict(arbitrary_types_allowed=True, frozen=True)
        name = "biased_test"
        bias: torch.Tensor

        def propose(self, state, ctx):
            n = min(len(self.bias), ctx.max_tokens)
            return DraftProposal(tokens=(self.bias[:n] + ctx.tokens[-1]) % TINY_VOCAB, parents=torch.arange(n))

    model = make_tiny_model(seed=38)
    prompts = _prompts(3, seed=62)
    ref = [alone_tokens(model, p, 10) for p in prompts]
    drafter = Biased(bias=torch.tensor([1, 2]))
    other = Biased(bias=torch.tensor([1, 3]))  # equal-looking objects whose == cannot be decided
    rows, res = _batched(model, prompts, [drafter], 10, eos_token_id=[])
    assert rows == ref and res.stats.drafted_tokens > 0
    from accel.drafting import _same_drafter
    assert _same_drafter(drafter, drafter) and not _same_drafter(drafter, other)


def test_a_malformed_proposal_fails_its_request_alone():
    from accel.strategy import DraftProposal

    class Malformed(accel.Drafter):
        name = "malformed_test"

        def propose(self, state, ctx):
            return DraftProposal(tokens=torch.tensor([1, 2]), parents=torch.zeros(1, dtype=torch.long))

    model = make_tiny_model(seed=39)
    prompt = _prompts(1, seed=63)[0]
    with accel.Engine(model, max_batch=4, eos_token_id=[]) as engine:
        bad = engine.submit(prompt, max_new_tokens=8, strategies=[Malformed()])
        good = engine.submit(prompt, max_new_tokens=8)
        r = bad.result(timeout=60)
        assert r.finish_reason == "error" and "parents" in r.error
        assert good.result(timeout=60).tokens == alone_tokens(model, prompt, 8)


def test_a_new_row_probes_drafts_where_a_two_token_pass_is_dear_and_garbage_stops(monkeypatch):
    from accel import engine
    from accel.acceptance import Acceptance
    from accel.calibration.cost_model import CostTable
    from accel.tree import DraftTree

    # the shape calibration measured on an AMD EPYC Zen 3 (split kernel for one token): a
    # two-token pass costs 1.74x a one-token one, eight tokens 2.0x
    table = CostTable(tokens=(1, 2, 4, 8, 16), cache_lens=(256,), ms=((70.0, 122.0, 133.0, 141.0, 161.0),))
    plan = engine.plan_strategies([PromptLookup()])

    def new_row():
        return engine.Row(prompt=torch.arange(10), plan=plan, max_new_tokens=64, eos=frozenset())

    assert engine.draft_budgets(table, 256, [new_row()], 16) == [1]  # the slow start's first probe
    with monkeypatch.context() as m:
        m.setattr(engine, "EXPLORE_HITS", 0.0)
        assert engine.draft_budgets(table, 256, [new_row()], 16) == [0]  # the prior 1/2 alone never drafts here

    good, bad = new_row(), new_row()
    budgets = {"good": [], "bad": []}
    for _ in range(8):
        for name, row in (("good", good), ("bad", bad)):
            (k,) = engine.draft_budgets(table, 256, [row], 16)
            budgets[name].append(k)
            if k:
                tree = DraftTree.chain(5, list(range(6, 6 + k)))
                accepted = k if row is good else 0
                row.observe(tree, Acceptance(path=list(range(accepted + 1)), next_token=1), draft_s=0.0)
            else:
                row.observe(DraftTree.root_only(5), Acceptance(path=[0], next_token=1), draft_s=0.0)
    assert budgets["good"][:5] == [1, 2, 4, 8, 16]  # every draft accepted: the slow start doubles
    assert budgets["bad"][:3] == [1, 2, 4] and budgets["bad"][3:] == [0] * 5  # three probes, then none


def test_new_requests_start_from_what_earlier_ones_accepted_on_the_model():
    from accel import engine
    from accel.calibration.cost_model import CostTable

    # a two-token pass costs 1.74x a one-token one: only a row expecting much acceptance drafts
    table = CostTable(tokens=(1, 2, 4, 8, 16), cache_lens=(256,), ms=((70.0, 122.0, 133.0, 141.0, 161.0),))
    plan = engine.plan_strategies([PromptLookup()])
    model = make_tiny_model(seed=5)

    def new_row():  # a row of a batch of 5-8
        row = engine.Row(prompt=torch.arange(10), plan=plan, max_new_tokens=64, eos=frozenset(), memory_bucket=8)
        engine.start_from_memory(model, row)
        return row

    assert engine.remembered_acceptance(model, new_row()) is None
    assert engine.draft_budgets(table, 256, [new_row()], 16) == [1]  # nothing known: the optimistic probe
    useless = new_row()
    useless.hits, useless.misses, useless.drafted_steps = 0.05, 4.0, 6  # its drafts were rejected
    engine.remember(model, useless)
    memory = engine.remembered_acceptance(model, new_row())
    assert memory.rate == pytest.approx(0.05 / 4.05) and memory.steps == 6
    row = new_row()
    assert row.prior_steps == 6 and engine.planning_rate(row) < 0.5
    assert engine.draft_budgets(table, 256, [row], 16) == [0]  # no probe paid for again
    assert engine.draft_budgets(table, 256, [new_row()], 16) == [0]
    for bucket in (4, 1):  # another batch size learns apart; a row alone keeps the optimistic prior
        apart = engine.Row(prompt=torch.arange(10), plan=plan, max_new_tokens=64, eos=frozenset(), memory_bucket=bucket)
        engine.start_from_memory(model, apart)
        assert apart.prior_steps == 0 and engine.draft_budgets(table, 256, [apart], 16) == [1]
    other = make_tiny_model(seed=6)  # another model (or drafter set) knows nothing yet
    fresh = engine.Row(prompt=torch.arange(10), plan=plan, max_new_tokens=64, eos=frozenset(), memory_bucket=8)
    engine.start_from_memory(other, fresh)
    assert fresh.prior_steps == 0 and engine.draft_budgets(table, 256, [fresh], 16) == [1]
    for _ in range(20):  # requests whose drafts were accepted lift the memory again
        good = new_row()
        good.hits, good.misses, good.drafted_steps = 6.0, 0.5, 8
        engine.remember(model, good)
    assert engine.remembered_acceptance(model, new_row()).steps == engine.PRIOR_STEPS
    assert engine.draft_budgets(table, 256, [new_row()], 16) == [1]


def test_the_engine_remembers_acceptance_across_generate_calls():
    from accel import engine

    model = make_tiny_model(seed=8)
    prompts = [repetitive_prompt(3, 40)[0], repetitive_prompt(4, 40)[0]]
    plan_row = engine.Row(prompt=prompts[0], plan=engine.plan_strategies([PromptLookup()]), max_new_tokens=8,
                          eos=frozenset(), memory_bucket=2)
    assert engine.remembered_acceptance(model, plan_row) is None
    accel.generate(model, torch.stack(prompts), strategies=[PromptLookup()], max_new_tokens=24, eos_token_id=[])
    memory = engine.remembered_acceptance(model, plan_row)  # a batch of two
    assert memory is not None and 0.0 <= memory.rate <= 1.0 and memory.steps >= 2
    plan_row.memory_bucket = 4
    assert engine.remembered_acceptance(model, plan_row) is None


@pytest.mark.parametrize("calibration", ["off", "on"])
def test_admitted_rows_start_from_memory_only_where_costs_are_measured(monkeypatch, calibration):
    from accel import engine
    from accel.calibration import calibrate
    from helpers import fake_table

    monkeypatch.setenv("ACCEL_CALIBRATION", calibration)
    monkeypatch.setattr(calibrate, "step_costs", lambda model: fake_table([1, 64], [10.0, 10.0]))
    started = []
    monkeypatch.setattr(engine, "start_from_memory", lambda model, row: started.append(row))
    model = make_tiny_model(seed=9)
    accel.generate(model, repetitive_prompt(4, 30), strategies=[PromptLookup()], max_new_tokens=4, eos_token_id=[])
    assert len(started) == (1 if calibration == "on" else 0)
