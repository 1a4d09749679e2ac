"""Calibration: the cost model (pure, driven by hand-made tables), the cached measurement,
and the decisions that follow from it (draft allocation, auto prepacking)."""

from __future__ import annotations

import json

import pytest
import torch

from accel.calibration import calibrate, timing
from accel.cli import main
from accel.calibration.cost_model import (CostTable, DraftGuard, acceptance_gains, allocate_drafts, chosen_kernels, in_window,
                               split_rows, static_table, weight_layout)
from accel.kernels.cpu import PackedLinear, is_prepacked, is_transposed, packable_dtypes, prepack, prepack_supported
from accel.models import prepacked, load_model
from helpers import fake_measure, fake_table as table, make_tiny_model


FLAT = table([1, 64], [10.0, 10.0])
STEEP = table([1, 2, 64], [10.0, 20.0, 640.0])  # every extra token costs a whole step
KNEE = table([1, 8, 64], [10.0, 11.0, 80.0])  # nearly free up to 8 tokens, then linear


@pytest.fixture
def calib_cache(tmp_path, monkeypatch):
    """Calibration on, cached in a temporary ACCEL_CACHE."""
    monkeypatch.setenv("ACCEL_CACHE", str(tmp_path))
    monkeypatch.delenv("ACCEL_CALIBRATION", raising=False)
    return tmp_path


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a loaded 2-core machine makes 2 threads spin; timings are not checked
    yield
    torch.set_num_threads(threads)


def refuse(*args, **kwargs):
    raise AssertionError("must not measure")


# ---------------------------------------------------------------------------- allocation


def test_acceptance_gains_is_a_chain():
    assert acceptance_gains(0.5, 3) == [0.5, 0.25, 0.125]
    assert acceptance_gains(0.9, 0) == []
    with pytest.raises(ValueError):
        acceptance_gains(1.5, 2)


def test_flat_cost_gives_long_drafts_and_steep_cost_none():
    gains = [acceptance_gains(0.7, 10)]
    assert allocate_drafts(FLAT, 256, gains, max_per_row=10) == [10]
    assert allocate_drafts(STEEP, 256, gains, max_per_row=10) == [0]


def test_never_more_than_max_per_row_or_than_offered():
    gains = [acceptance_gains(0.9, 10), acceptance_gains(0.9, 2), []]
    k = allocate_drafts(FLAT, 256, gains, max_per_row=4)
    assert k == [4, 2, 0]
    assert allocate_drafts(FLAT, 256, gains, max_per_row=0) == [0, 0, 0]
    assert allocate_drafts(FLAT, 256, [], max_per_row=4) == []


def test_a_big_batch_gets_fewer_drafts_per_row_than_batch_one():
    single = allocate_drafts(KNEE, 256, [acceptance_gains(0.8, 16)], max_per_row=16)
    batch = allocate_drafts(KNEE, 256, [acceptance_gains(0.8, 16)] * 16, max_per_row=16)
    assert single[0] >= 5
    assert max(batch) < single[0] and sum(batch) / 16 < single[0]


def test_rows_with_low_acceptance_get_none_while_good_rows_draft():
    gains = [acceptance_gains(0.9, 8), acceptance_gains(0.02, 8), acceptance_gains(0.85, 8), [0.0] * 8]
    # every drafting row pays 1 ms for its drafter: the 2% row does not earn it back
    k = allocate_drafts(KNEE, 256, gains, max_per_row=8, drafter_ms=[1.0] * 4)
    assert k[1] == 0 and k[3] == 0
    assert k[0] > 0 and k[2] > 0 and k[0] == k[2]  # one padded depth for the drafting rows
    # a drafter that costs nothing drafts below the deepest row for free, except with no gain at all
    free = allocate_drafts(KNEE, 256, gains, max_per_row=8)
    assert free[3] == 0 and free[0] == free[1] == free[2] > 0


def test_look_ahead_positions_are_charged_to_the_rows_that_draft():
    # KNEE: 8 tokens cost 1.1 steps, then each token 1/7 ms more than that. A row that gains
    # 0.3 tokens from one draft pays for it alone, but not with 8 look-ahead positions on top
    gains = [[0.3]]
    assert allocate_drafts(KNEE, 256, gains, max_per_row=4) == [1]
    assert allocate_drafts(KNEE, 256, gains, max_per_row=4, extra_nodes=[8]) == [0]
    assert allocate_drafts(KNEE, 256, gains, max_per_row=4, extra_nodes=[2]) == [1]  # still inside the knee
    # in a batch the positions widen every row's padded pass: a look-ahead row that would have
    # drafted beside rows without look-ahead is dropped, the others keep drafting
    rows = [acceptance_gains(0.8, 4)] * 3 + [[0.3]]
    assert allocate_drafts(KNEE, 256, rows, max_per_row=4, extra_nodes=[0, 0, 0, 0])[3] == 1
    k = allocate_drafts(KNEE, 256, rows, max_per_row=4, drafter_ms=[0.5] * 4, extra_nodes=[0, 0, 0, 12])
    assert k[3] == 0 and min(k[:3]) > 0
    with pytest.raises(ValueError, match="extra_nodes"):
        allocate_drafts(KNEE, 256, gains, max_per_row=4, extra_nodes=[1, 2])


def test_padding_makes_one_deep_row_cost_the_whole_batch():
    # verify cost is linear in padded tokens: one good row among seven useless ones pays for
    # eight rows per extra depth, so it drafts less than it would alone
    steep = table([1, 64], [10.0, 73.0])
    alone = allocate_drafts(steep, 256, [acceptance_gains(0.8, 8)], max_per_row=8)
    among = allocate_drafts(steep, 256, [acceptance_gains(0.8, 8)] + [[0.0] * 8] * 7, max_per_row=8)
    assert alone[0] > among[0] and among[1:] == [0] * 7


def test_allocation_looks_past_a_bump_in_the_cost_curve():
    # the first draft token doubles the step, the next six are free: a rule that stops at
    # the first token not raising the ratio would draft nothing
    bump = table([1, 2, 8, 64], [10.0, 20.0, 20.5, 200.0])
    assert allocate_drafts(bump, 256, [acceptance_gains(0.9, 7)], max_per_row=7) == [7]


def test_drafter_cost_is_paid_once_per_drafting_row():
    gains = [acceptance_gains(0.9, 4)] * 2
    assert allocate_drafts(FLAT, 256, gains, max_per_row=4, drafter_ms=[0.0, 0.0]) == [4, 4]
    # row 1's drafter costs more than anything it could bring; row 0's is cheap
    assert allocate_drafts(FLAT, 256, gains, max_per_row=4, drafter_ms=[0.5, 1000.0]) == [4, 0]
    # one token alone does not pay for a 15 ms drafter, four tokens do
    alone = allocate_drafts(FLAT, 256, [acceptance_gains(0.9, 1)], max_per_row=1, drafter_ms=[15.0])
    four = allocate_drafts(FLAT, 256, [acceptance_gains(0.9, 4)], max_per_row=4, drafter_ms=[15.0])
    assert alone == [0] and four == [4]
    with pytest.raises(ValueError):
        allocate_drafts(FLAT, 256, gains, max_per_row=4, drafter_ms=[1.0])


def test_longer_cache_affords_fewer_drafts_when_it_is_steeper():
    t = table([1, 8, 64], [[10.0, 11.0, 30.0], [20.0, 40.0, 200.0]], cache_lens=(256, 4096))
    gains = [acceptance_gains(0.8, 16)]
    short, long = allocate_drafts(t, 256, gains, 16), allocate_drafts(t, 4096, gains, 16)
    assert short[0] > long[0]


# ---------------------------------------------------------------------------- the table


def test_step_ms_interpolates_and_extrapolates_linearly():
    t = table([1, 3, 5], [[10.0, 20.0, 40.0], [30.0, 40.0, 60.0]], cache_lens=(100, 300))
    assert t.step_ms(3, 100) == pytest.approx(20.0)
    assert t.step_ms(2, 100) == pytest.approx(15.0)
    assert t.step_ms(3, 200) == pytest.approx(30.0)
    assert t.step_ms(2, 200) == pytest.approx(25.0)  # bilinear
    assert t.step_ms(7, 100) == pytest.approx(60.0)  # past the last token: last slope
    assert t.step_ms(1, 500) == pytest.approx(50.0)  # past the longest cache
    assert t.step_ms(0, 100) == pytest.approx(5.0)
    assert t.step_ms(1, -10_000) > 0  # extrapolated below zero: still a positive cost
    assert t.curve(200, 6) == pytest.approx([t.step_ms(n, 200) for n in range(7)])
    single = table([4], [7.0])
    assert single.step_ms(1, 9999) == single.step_ms(64, 1) == 7.0


def test_batch_passes_scale_the_grid_by_what_they_measured():
    from dataclasses import replace

    one_row = table([1, 8, 16], [10.0, 12.0, 14.0], cache_lens=(256,))
    assert one_row.pass_ms(8, 2, 256) == one_row.step_ms(16, 256)  # no batch passes measured: tokens are tokens
    # 8 rows x 1 token measured 12 ms (as the grid's 8 tokens), 8 rows x 2 tokens 18.2 ms (1.3x the grid's 16)
    t = replace(one_row, batch_rows=(8,), batch_tokens=(1, 2), batch_ms=((12.0, 18.2),), batch_cache=256)
    assert t.batch_factor(8, 1) == pytest.approx(1.0) and t.batch_factor(8, 2) == pytest.approx(1.3)
    assert t.pass_ms(8, 2, 256) == pytest.approx(18.2)
    assert t.batch_factor(8, 4) == pytest.approx(1.3)  # held past the measured tokens per row
    assert t.batch_factor(16, 2) == pytest.approx(1.3)  # and past the most rows measured
    assert t.batch_factor(1, 2) == 1.0 and t.batch_factor(4, 2) == pytest.approx(1 + 0.3 * 3 / 7)  # from 1.0 at one row
    assert t.batch_curve(256, 8, 3) == pytest.approx([t.pass_ms(8, w, 256) for w in range(4)])
    assert CostTable.from_dict(json.loads(json.dumps(t.to_dict()))) == t
    with pytest.raises(ValueError, match="batch_ms"):
        replace(one_row, batch_rows=(8,), batch_tokens=(1, 2), batch_ms=((12.0,),), batch_cache=256)
    with pytest.raises(ValueError, match="rows >= 2"):
        replace(one_row, batch_rows=(1,), batch_tokens=(1,), batch_ms=((12.0,),), batch_cache=256)


def test_a_batch_whose_tree_pass_measured_dearer_than_its_tokens_drafts_less():
    from dataclasses import replace

    # the one-row grid: 16 tokens cost 1.12x 8 tokens, so 8 rows accepting 20% of their first
    # draft gain 1.2 / 1.12 by drafting one each; measured, a batch of 8 rows x 2 tokens costs
    # 1.3x 8 rows x 1 token, so drafting loses
    one_row = table([1, 8, 16], [38.0, 50.6, 56.8], cache_lens=(256,))
    rows = [acceptance_gains(0.2, 4)] * 8
    assert max(allocate_drafts(one_row, 256, rows, max_per_row=4)) >= 1
    batched = replace(one_row, batch_rows=(8,), batch_tokens=(1, 2, 4), batch_ms=((50.6, 65.8, 90.0),), batch_cache=256)
    assert allocate_drafts(batched, 256, rows, max_per_row=4) == [0] * 8
    assert allocate_drafts(batched, 256, [acceptance_gains(0.2, 4)], max_per_row=4)[0] >= 1  # one row: the grid


@pytest.mark.parametrize("bad", [
    dict(tokens=(1, 1), ms=((1.0, 1.0),)),
    dict(tokens=(2, 1), ms=((1.0, 1.0),)),
    dict(tokens=(1, 2), ms=((1.0,),)),
    dict(tokens=(1, 2), ms=((1.0, 0.0),)),
    dict(tokens=(1, 2), ms=((1.0, float("nan")),)),
    dict(tokens=(1, 2), ms=((1.0, 2.0),), kernel_tokens=(1,), kernel_ms={"fast": ((1.0,),)}),
])
def test_malformed_tables_are_refused(bad):
    with pytest.raises(ValueError):
        CostTable(cache_lens=(256,), **bad)


def test_packed_rows_is_the_window_where_packed_kernels_win():
    tokens = (1, 4, 8, 64)

    def with_kernels(plain, packed, second=None):
        grids = {"plain": (tuple(plain),) * (2 if second else 1)}
        if packed:
            grids["packed"] = (tuple(packed),) + ((tuple(second),) if second else ())
        return table(tokens, [1.0, 2.0, 3.0, 4.0], cache_lens=(256, 2048)[: 2 if second else 1],
                     kernel_tokens=tokens, kernel_ms=grids)

    plain = [10.0, 20.0, 30.0, 40.0]
    everywhere = with_kernels(plain, [8.0, 15.0, 25.0, 35.0])
    assert everywhere.packed_rows == (1, None) and everywhere.prefer_prepack and everywhere.kernels == "packed"
    # the Intel Xeon's shape: plain wins for one row and for many, packed in between
    intel = with_kernels(plain, [12.0, 15.0, 25.0, 45.0])
    assert intel.packed_rows == (4, 8) and intel.kernels == "packed for 4-8 tokens, plain otherwise"
    assert with_kernels(plain, [12.0, 15.0, 25.0, 35.0]).packed_rows == (4, None)  # on past the grid
    assert with_kernels(plain, [8.0, 25.0, 25.0, 35.0]).packed_rows == (8, None)  # the longest run wins
    assert with_kernels(plain, [8.0, 25.0, 35.0, 35.0]).packed_rows == (64, None)  # a tie: the larger
    # every cache length must agree
    assert with_kernels(plain, [8.0, 15.0, 25.0, 35.0], second=[8.0, 25.0, 25.0, 35.0]).packed_rows == (8, None)
    assert with_kernels(plain, [15.0, 30.0, 45.0, 60.0]).packed_rows is None
    plain_only = with_kernels(plain, None)
    assert plain_only.packed_rows is None and not plain_only.prefer_prepack and plain_only.kernels == "plain"
    assert in_window(4, (4, 8)) and in_window(8, (4, 8)) and not in_window(9, (4, 8)) and not in_window(3, (4, 8))
    assert in_window(10_000, (4, None)) and not in_window(1, None)
    assert not static_table().prefer_prepack and not static_table().measured


def test_weight_layout_is_transposed_where_it_wins_on_the_geometric_mean():
    tokens = (1, 2, 8, 32)
    plain = (10.0, 12.0, 20.0, 40.0)

    def layout(transposed, packed=None):
        grids = {"plain": (plain,), "transposed": (tuple(transposed),)}
        if packed:
            grids["packed"] = (tuple(packed),)
        return table(tokens, [1.0, 2.0, 3.0, 4.0], kernel_tokens=tokens, kernel_ms=grids)

    # the Intel Xeon's shape: equal for one token, worse for two, much better for more
    intel = layout([10.0, 14.0, 14.0, 26.0])
    assert intel.transposed and weight_layout(intel.kernel_ms) == "transposed" and intel.kernels == "transposed"
    assert not layout([10.0, 14.0, 19.0, 39.0]).transposed  # a loss and small gains: no better
    assert not layout([9.9, 11.9, 19.9, 39.9]).transposed  # within the margin: a tie is noise
    assert not layout([11.0, 13.0, 22.0, 44.0]).transposed
    # packed kernels are judged against the layout chosen, not against plain ones
    mixed = layout([10.0, 14.0, 14.0, 26.0], packed=[8.0, 13.0, 15.0, 30.0])
    assert mixed.packed_rows == (1, 2) and mixed.kernels == "packed for 1-2 tokens, transposed otherwise"
    assert layout([11.0, 13.0, 22.0, 44.0], packed=[8.0, 13.0, 15.0, 30.0]).packed_rows == (8, None)
    assert weight_layout({"plain": ((1.0,),)}) == "plain" and not static_table().transposed
    # the AMD EPYC (Zen 3)'s shape: transposed weights win only for one token and lose alone,
    # packed kernels win for the rest against either: transposed beside the packed window
    zen3 = [8.3, 12.0, 24.0, 46.0]
    assert not layout(zen3).transposed
    both = layout(zen3, packed=[10.0, 9.5, 17.0, 34.0])
    assert both.transposed and both.packed_rows == (2, None)
    assert both.kernels == "packed for 2-any tokens, transposed otherwise"
    # ... unless the one-token gain is within the margin
    assert not layout([9.8, 12.0, 24.0, 46.0], packed=[10.0, 9.5, 17.0, 34.0]).transposed


def test_a_table_is_read_for_the_kernels_the_model_runs():
    """run_with rebuilds the grid from the kernel passes a model really runs: plain ones for a
    model loaded by plain transformers, whatever the measurement chose."""
    tokens = (1, 2, 8, 32)
    grids = {"plain": ((10.0, 12.0, 20.0, 40.0),), "transposed": ((10.0, 14.0, 14.0, 26.0),),
             "packed": ((8.0, 13.0, 15.0, 30.0),)}
    chosen = table(tokens, [8.0, 13.0, 14.0, 26.0], kernel_tokens=tokens, kernel_ms=grids)
    assert chosen.transposed and chosen.packed_rows == (1, 2)
    assert chosen.run_with(True, (1, 2)) is chosen  # what load_model applies: the table itself
    assert chosen.run_with(False, None).ms == grids["plain"]
    assert chosen.run_with(True, None).ms == grids["transposed"]
    assert chosen.run_with(False, (8, None)).ms == ((10.0, 12.0, 15.0, 30.0),)
    assert chosen.run_with(False, (1, None)).ms == ((8.0, 13.0, 15.0, 30.0),)
    no_packed = table(tokens, [1.0, 2.0, 3.0, 4.0], kernel_tokens=tokens, kernel_ms={"plain": grids["plain"]})
    assert no_packed.run_with(False, (1, 2)) is no_packed  # not measured: nothing better to say
    static = static_table()
    assert static.run_with(True, None) is static  # no kernel passes: a shape, not milliseconds


def test_step_costs_follow_the_weight_layout_the_model_has(monkeypatch):
    from accel.kernels import cpu

    tokens = (1, 2, 8, 32)
    grids = {"plain": ((10.0, 12.0, 20.0, 40.0),), "transposed": ((10.0, 14.0, 14.0, 26.0),)}
    chosen = table(tokens, [10.0, 14.0, 14.0, 26.0], kernel_tokens=tokens, kernel_ms=grids)
    monkeypatch.setattr(calibrate, "cost_table", lambda model: chosen)
    model = make_tiny_model()  # as plain transformers loads it: row-major weights
    assert calibrate.step_costs(model).ms == grids["plain"]
    cpu.transpose_weights(model)
    assert calibrate.step_costs(model) is chosen


# ---------------------------------------------------------------------------- keys and files


def test_key_follows_threads_dtype_and_model_sizes(one_thread):
    model = make_tiny_model()
    key = calibrate.calibration_key(model)
    assert key == calibrate.calibration_key(make_tiny_model(seed=5))  # weights do not matter
    assert {"model", "device", "dtype", "threads", "machine"} <= key.keys()
    assert key["machine"]["cpu"] and key["machine"]["torch"] == torch.__version__
    path = calibrate.calibration_path(key)
    torch.set_num_threads(2)
    assert calibrate.calibration_path(calibrate.calibration_key(model)) != path
    torch.set_num_threads(1)
    assert calibrate.calibration_path(calibrate.calibration_key(model.to(torch.bfloat16))) != path
    assert calibrate.calibration_key(make_tiny_model(hidden_size=32)) != key


def test_round_trip_to_disk(calib_cache):
    t = table([1, 8], [[1.0, 2.5], [3.0, 4.0]], cache_lens=(16, 64), kernel_tokens=(1,),
              kernel_ms={"plain": ((2.0,), (3.0,)), "packed": ((1.0,), (2.0,))}, key={"a": [1, "b"]}, seconds=1.5, load=0.5)
    path = calib_cache / "calibration" / "x.json"
    calibrate.save_table(path, t)
    assert calibrate.load_table(path, {"a": [1, "b"]}) == t
    assert calibrate.load_table(path, {"a": [2]}) is None  # measured for something else
    assert [p.name for p in path.parent.iterdir()] == ["x.json"]  # no temporary left behind


def test_cost_table_measures_once_then_reads_the_cache(calib_cache, monkeypatch):
    calls: list = []
    monkeypatch.setattr(timing, "measure", fake_measure(calls))
    model = make_tiny_model()
    first = calibrate.cost_table(model)
    assert len(calls) == 1 and first.measured and first.key == json.loads(json.dumps(calibrate.calibration_key(model)))
    path = calibrate.calibration_path(calibrate.calibration_key(model))
    assert path.is_file() and path.parent == calib_cache / "calibration"
    monkeypatch.setattr(timing, "measure", refuse)
    assert calibrate.cost_table(model) == first
    monkeypatch.setattr(timing, "measure", fake_measure(calls))
    calibrate.cost_table(model, force=True)
    assert len(calls) == 2


@pytest.mark.parametrize("content", ["{not json", '{"tokens": [1]}', "[]", ""])
def test_a_corrupt_file_is_ignored_and_measured_again(calib_cache, monkeypatch, content):
    model = make_tiny_model()
    path = calibrate.calibration_path(calibrate.calibration_key(model))
    path.parent.mkdir(parents=True)
    path.write_text(content)
    calls: list = []
    monkeypatch.setattr(timing, "measure", fake_measure(calls))
    assert calibrate.cost_table(model).measured and len(calls) == 1
    assert calibrate.load_table(path, calibrate.calibration_key(model)) is not None  # rewritten


def test_a_foreign_file_is_ignored(calib_cache, monkeypatch):
    model = make_tiny_model()
    key = calibrate.calibration_key(model)
    path = calibrate.calibration_path(key)
    calibrate.save_table(path, table([1], [1.0], key=dict(key, threads=key["threads"] + 7)))
    calls: list = []
    monkeypatch.setattr(timing, "measure", fake_measure(calls))
    calibrate.cost_table(model)
    assert len(calls) == 1


def test_calibration_off_gives_static_defaults_without_measuring(calib_cache, monkeypatch):
    monkeypatch.setenv("ACCEL_CALIBRATION", "off")
    monkeypatch.setattr(timing, "measure", refuse)
    t = calibrate.cost_table(make_tiny_model())
    assert t == static_table() and not t.measured and not t.prefer_prepack
    assert not (calib_cache / "calibration").exists()
    monkeypatch.setenv("ACCEL_CALIBRATION", "sometimes")
    with pytest.raises(ValueError):
        calibrate.cost_table(make_tiny_model())


# ---------------------------------------------------------------------------- measuring


@pytest.mark.parametrize("packed", [False, True])
def test_a_real_measurement_on_a_tiny_model(one_thread, packed):
    model = make_tiny_model()
    if packed:
        if not prepack_supported():
            pytest.skip("no oneDNN packing")
        prepack(model)
    t = timing.measure(model, tokens=(1, 4), cache_lens=(16, 600), repeats=2)
    assert t.measured and t.tokens == (1, 4) and t.kernel_tokens == t.tokens and t.seconds > 0
    assert t.cache_lens == (16, 512 - 4)  # capped to the model's 512 positions
    assert all(x > 0 for row in t.ms for x in row)
    assert set(t.kernel_ms) == ({"plain", "transposed", "packed", "split"} if prepack_supported()
                                else {"plain", "transposed"})
    # the grid holds, token count by token count, the time of the kernels the choice picks
    for ti, n in enumerate(t.tokens):
        name = chosen_kernels(t.tokens, "transposed" if t.transposed else "plain", t.packed_rows, t.split_rows)[ti]
        assert name == ("split" if n <= t.split_rows else "packed" if in_window(n, t.packed_rows)
                        else "transposed" if t.transposed else "plain")
        assert t.ms[0][ti] >= t.kernel_ms[name][0][ti]  # (made non-decreasing: never below)
        if ti == 0:
            assert t.ms[0][0] == t.kernel_ms[name][0][0]
    assert t.step_ms(3, 100) > 0
    # batch passes: every (rows, tokens per row) point of the defaults, over the first cache length
    assert t.batch_rows == timing.DEFAULT_BATCH_ROWS and t.batch_tokens == timing.DEFAULT_BATCH_TOKENS
    assert t.batch_cache == 16 and all(x > 0 for row in t.batch_ms for x in row)
    assert len(t.batch_ms) == len(t.batch_rows) and all(len(r) == len(t.batch_tokens) for r in t.batch_ms)
    assert timing.measure(model, tokens=(1, 2), cache_lens=(8,), repeats=1, batch_rows=()).batch_ms == ()
    assert is_prepacked(model) == packed and not is_transposed(model)  # the model is left with the kernels it had
    # a bf16 model: packed kernels too where this CPU multiplies bf16 natively; float16: plain only
    low = timing.measure(make_tiny_model().to(torch.bfloat16), tokens=(1, 2), cache_lens=(8,), repeats=1)
    assert set(low.kernel_ms) == ({"plain", "packed"} if torch.bfloat16 in packable_dtypes() else {"plain"})
    assert not low.transposed
    half = timing.measure(make_tiny_model().to(torch.float16), tokens=(1, 2), cache_lens=(8,), repeats=1)
    assert set(half.kernel_ms) == {"plain"} and not half.transposed and half.packed_rows is None


def test_a_burst_of_load_on_one_kernel_does_not_decide_between_kernels(monkeypatch):
    """Each point keeps its fastest pass: a busy machine only adds time, so one slow sample
    of the faster kernel must not hand the choice to a slower one."""
    model = make_tiny_model()
    seen: dict[str, int] = {}

    def fake_pass(model, cache, tokens, repeats, warmup=1):
        kernel = "packed" if is_prepacked(model) else ("transposed" if is_transposed(model) else "plain")
        first = seen.get((kernel, tokens), 0) == 0
        seen[(kernel, tokens)] = seen.get((kernel, tokens), 0) + 1
        cost = {"plain": 10.0, "transposed": 8.0, "packed": 12.0}[kernel] * tokens
        return [cost + (50.0 if kernel == "transposed" and first else 0.0)] * repeats  # a burst on its first round

    monkeypatch.setattr(timing, "time_pass", fake_pass)
    t = timing.measure(model, tokens=(1, 2), cache_lens=(8,), repeats=1, budget_s=1e9)
    assert t.kernel_ms["transposed"] == ((8.0, 16.0),) and t.transposed
    assert t.ms == ((8.0, 16.0),) and not is_transposed(model)


def test_cost_table_measures_for_real_into_the_cache(calib_cache, one_thread):
    model = make_tiny_model()
    t = calibrate.cost_table(model, tokens=(1, 2), cache_lens=(8,), repeats=1)
    assert t.measured and calibrate.cost_table(model) == t


# ---------------------------------------------------------------------------- decisions


@pytest.mark.skipif(not prepack_supported(), reason="no oneDNN packing")
@pytest.mark.parametrize("wins, window", [((), None), ((1, 8, 64), (1, None)), ((8,), (8, 8)), ((8, 64), (8, None))])
def test_auto_prepack_follows_the_table(calib_cache, monkeypatch, tmp_path, wins, window):
    monkeypatch.setattr(timing, "measure", fake_measure(packed=wins))

    def packed_rows(model):
        windows = {(m.min_rows, m.max_rows) for m in model.modules() if isinstance(m, PackedLinear)}
        assert len(windows) <= 1
        return windows.pop() if windows else None

    assert packed_rows(prepacked(make_tiny_model(), "auto")) == window
    folder = tmp_path / "tiny"
    make_tiny_model().save_pretrained(folder)
    model, _ = load_model(folder)  # prepack="auto" by default, reading the cached table now
    assert packed_rows(model) == window
    monkeypatch.setattr(timing, "measure", refuse)
    assert packed_rows(load_model(folder, prepack=True)[0]) == (1, None)
    assert not is_prepacked(load_model(folder, prepack=False)[0])


@pytest.mark.skipif(torch.bfloat16 not in packable_dtypes(), reason="this CPU has no bf16 instructions for packed kernels")
@pytest.mark.parametrize("wins, window", [((), None), ((8, 64), (8, None))])
def test_auto_prepack_packs_bf16_models_and_a_quantized_models_float_layers(calib_cache, monkeypatch, wins, window):
    monkeypatch.setattr(timing, "measure", fake_measure(packed=wins))
    model = prepacked(make_tiny_model().to(torch.bfloat16), "auto")
    windows = {(m.min_rows, m.max_rows) for m in model.modules() if isinstance(m, PackedLinear)}
    assert windows == (set() if window is None else {window})
    if window is not None:  # every linear layer, the output layer included; the numbers stay bf16's
        assert isinstance(model.get_output_embeddings(), PackedLinear)
        assert not any(type(m) is torch.nn.Linear for m in model.modules())
        ids = torch.tensor([[4, 8, 15, 16, 23, 42, 7, 9]])
        with torch.inference_mode():
            torch.testing.assert_close(model(ids).logits, make_tiny_model().to(torch.bfloat16)(ids).logits,
                                       rtol=0.05, atol=0.05)
    from accel.kernels import lowbit

    if lowbit.kernel_problem("int8") is None:  # quantized: its bf16 output layer is packed, its int8 layers stay
        def load(dtype, device, prepack, quantize):
            assert prepack is False  # packing comes after quantizing, on the quantized model's own table
            return make_tiny_model(), None

        quantized, _ = lowbit.load_quantized(load, quantize="int8", dtype="bfloat16", device="cpu", prepack="auto",
                                              pack=prepacked)
        assert isinstance(quantized.get_output_embeddings(), PackedLinear) == (window is not None)
        assert lowbit.quantization_of(quantized).quantized == 2 * 7


@pytest.mark.parametrize("transposed_ms, transposed", [(1.0, True), (2.0, False), (3.0, False)])
def test_auto_kernels_store_weights_transposed_where_that_measured_faster(calib_cache, monkeypatch, transposed_ms,
                                                                          transposed):
    monkeypatch.setattr(timing, "measure", fake_measure(packed=(64,), transposed=transposed_ms))
    reference = make_tiny_model()
    model = prepacked(make_tiny_model(), "auto")
    assert is_transposed(model) == transposed
    # packed where packing beats the layout chosen: at 64 tokens (1 ms) against plain's and transposed's 1-3 ms
    windows = {(m.min_rows, m.max_rows) for m in model.modules() if isinstance(m, PackedLinear)}
    assert windows == ({(64, None)} if transposed_ms > 1.0 and prepack_supported() else set())
    ids = torch.tensor([[4, 8, 15, 16, 23]])
    with torch.inference_mode():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=1e-4, atol=1e-5)


def test_auto_prepack_is_off_without_calibration_or_off_a_packable_cpu_model(calib_cache, monkeypatch):
    monkeypatch.setattr(timing, "measure", refuse)
    assert not is_prepacked(prepacked(make_tiny_model().to(torch.float16), "auto"))  # nothing to decide
    from accel.kernels.cpu import bf16_native, prepack_available

    assert (torch.bfloat16 in packable_dtypes()) == (bf16_native() and prepack_available(torch.bfloat16))
    if torch.bfloat16 not in packable_dtypes():
        assert not is_prepacked(prepacked(make_tiny_model().to(torch.bfloat16), "auto"))
    monkeypatch.setenv("ACCEL_CALIBRATION", "off")
    assert not is_prepacked(prepacked(make_tiny_model(), "auto"))
    with pytest.raises(ValueError):
        prepacked(make_tiny_model(), "yes")


def test_cli_calibrate_prints_the_table_and_where_it_is_cached(calib_cache, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(timing, "measure", fake_measure())
    folder = tmp_path / "tiny"
    make_tiny_model().save_pretrained(folder)
    threads = torch.get_num_threads()
    try:
        assert main(["calibrate", "--model", str(folder), "--threads", "1"]) == 0
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert "verify pass" in out and "prefer_prepack: False" in out and str(calib_cache / "calibration") in out
    assert "batch passes" in out and "(1.50x)" in out
    assert main(["calibrate", "--model", str(folder), "--threads", "0"]) == 2


def test_measured_grid_is_made_non_decreasing():
    from accel.calibration.cost_model import monotone as _monotone

    assert _monotone([[5.0, 4.0, 6.0], [3.0, 7.0, 6.5]]) == ((5.0, 5.0, 6.0), (5.0, 7.0, 7.0))


@pytest.mark.skipif(not prepack_supported(), reason="no oneDNN packing")
@pytest.mark.parametrize("start_packed", [False, True])
def test_linear_kernels_switches_and_restores(start_packed):
    model = make_tiny_model(seed=3)
    if start_packed:
        prepack(model, min_rows=2, max_rows=3)  # a window: measuring "packed" must ignore it
    before = dict(model.named_modules())
    ids = torch.tensor([[4, 8, 15, 16, 23]])
    with torch.inference_mode(), timing.linear_kernels(model) as use:
        use("packed")
        assert is_prepacked(model)
        assert {(m.min_rows, m.max_rows) for m in model.modules() if isinstance(m, PackedLinear)} == {(1, None)}
        packed = model(ids).logits
        use("plain")
        assert not is_prepacked(model) and not is_transposed(model)
        torch.testing.assert_close(model(ids).logits, packed, rtol=1e-4, atol=1e-5)
        use("transposed")
        assert not is_prepacked(model) and is_transposed(model)
        torch.testing.assert_close(model(ids).logits, packed, rtol=1e-4, atol=1e-5)
        use("packed")  # packed again after a layout change: the packed copies follow the weights
        assert all(m._packed_from == m._weight_key() for m in model.modules() if isinstance(m, PackedLinear))
        torch.testing.assert_close(model(ids).logits, packed, rtol=1e-4, atol=1e-5)
        with pytest.raises(ValueError, match="kernel must be one of"):
            use("fast")
    assert dict(model.named_modules()) == before  # the very same modules are back
    assert not is_transposed(model)
    if start_packed:
        assert {(m.min_rows, m.max_rows) for m in model.modules() if isinstance(m, PackedLinear)} == {(2, 3)}


def test_a_flat_measured_top_segment_does_not_make_bigger_passes_free():
    flat_top = table([1, 16, 32, 64], [40.0, 130.0, 185.0, 185.0])
    assert flat_top.step_ms(128, 256) > flat_top.step_ms(64, 256) * 1.5  # the chord's slope past the grid
    # so sixteen rows at 30% acceptance are not given deep trees
    k = allocate_drafts(flat_top, 256, [acceptance_gains(0.3, 16)] * 16, 16)
    assert k == [0] * 16


# ---------------------------------------------------------------------------- the guard


def _run_guard(guard: DraftGuard, plain_speed: float, draft_speed: float, steps: int) -> list[bool]:
    """Drive ``guard`` for ``steps`` steps in which a drafting step scores ``draft_speed`` and
    a plain one ``plain_speed``; returns whether each step was allowed to draft."""
    allowed = []
    for _ in range(steps):
        ok = guard.allow()
        allowed.append(ok)
        guard.observe(ok, draft_speed if ok else plain_speed)
    return allowed


def test_guard_stops_drafting_that_does_not_pay_and_tries_again_ever_later():
    guard = DraftGuard(patience=3, cooldown=4, max_cooldown=16, probe=2)
    allowed = _run_guard(guard, plain_speed=1.0, draft_speed=0.8, steps=60)
    # 3 drafting steps, 2 plain probes (no plain step seen yet), 1 more drafting step judged
    assert allowed[:6] == [True, True, True, False, False, True]
    assert guard.failures >= 1
    off_runs, run = [], 0
    for ok in allowed[6:]:
        if ok and run:
            off_runs.append(run)
            run = 0
        run += not ok
    assert off_runs[:3] == [4, 8, 16] and all(r == 16 for r in off_runs[3:])  # doubling, capped
    assert sum(allowed) / len(allowed) < 0.4  # mostly plain decoding now


def test_guard_keeps_drafting_that_pays():
    guard = DraftGuard(patience=3)
    guard.observe(False, 1.0)  # a plain step seen
    assert all(_run_guard(guard, plain_speed=1.0, draft_speed=1.3, steps=50))
    assert guard.failures == 0 and guard.draft == pytest.approx(1.3)


def test_guard_judges_against_this_batch_s_plain_steps_not_an_absolute():
    # the table may be off for this batch: plain steps score 0.5, drafting 0.6 still pays
    guard = DraftGuard(patience=2, probe=1)
    allowed = _run_guard(guard, plain_speed=0.5, draft_speed=0.6, steps=30)
    assert allowed[:4] == [True, True, False, True] and all(allowed[3:])
    # and a drafting score above 1.0 does not pay when plain steps of this batch score more
    guard = DraftGuard(patience=2, probe=1, cooldown=5)
    assert not all(_run_guard(guard, plain_speed=1.6, draft_speed=1.2, steps=30))
    assert guard.failures >= 1


def test_guard_ignores_meaningless_speeds():
    guard = DraftGuard(patience=1)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        guard.observe(True, bad)
    assert guard.tried == 0 and guard.draft is None and guard.allow()


# ---------------------------------------------------------------------------- per-token drafter costs


def test_a_per_token_drafter_cost_stops_the_chain_where_it_stops_paying():
    gains = [acceptance_gains(0.9, 8)]
    # 10 ms a step whatever it verifies; each draft token costs its drafter 3 ms more: the
    # tokens per ms (1 + 0.9 + ... + 0.9**m) / (10 + 3 m) peak at m = 5
    assert allocate_drafts(FLAT, 256, gains, max_per_row=8, drafter_ms=[0.0], drafter_ms_per_token=[3.0]) == [5]
    assert allocate_drafts(FLAT, 256, gains, max_per_row=8, drafter_ms=[0.0], drafter_ms_per_token=[0.0]) == [8]
    # a draft token that costs three plain steps never pays
    assert allocate_drafts(FLAT, 256, gains, max_per_row=8, drafter_ms_per_token=[30.0]) == [0]
    with pytest.raises(ValueError, match="drafter_ms_per_token"):
        allocate_drafts(FLAT, 256, gains, max_per_row=8, drafter_ms_per_token=[1.0, 2.0])


def test_draft_cost_fits_a_line_in_the_tokens_drafted():
    from accel.calibration.cost_model import DraftCost

    assert DraftCost().fit() == (0.0, 0.0)
    chain = DraftCost()  # a draft model: 45 ms a token, nothing fixed
    for k in (1, 2, 4, 5, 5):
        chain.observe(k, 45.0 * k)
    fixed, per_token = chain.fit()
    assert fixed == pytest.approx(0.0, abs=1e-6) and per_token == pytest.approx(45.0)
    mixed = DraftCost()
    for k in (1, 2, 4, 8):
        mixed.observe(k, 10.0 + 3.0 * k)
    assert mixed.fit() == pytest.approx((10.0, 3.0))
    flat = DraftCost()  # one k seen: all of it fixed
    for _ in range(3):
        flat.observe(4, 7.0)
    assert flat.fit() == pytest.approx((7.0, 0.0))
    falling = DraftCost()  # cheaper with more tokens (noise): never a negative slope
    for k, ms in ((1, 9.0), (4, 3.0)):
        falling.observe(k, ms)
    assert falling.fit()[1] == 0.0 and falling.fit()[0] > 0
    steep = DraftCost()  # a line that would cross below zero: through the origin instead
    for k, ms in ((1, 1.0), (2, 20.0)):
        steep.observe(k, ms)
    fixed, per_token = steep.fit()
    assert fixed == 0.0 and per_token == pytest.approx(steep._m / steep._k)


# ---------------------------------------------------------------------------- int8 drafts


@pytest.fixture
def fake_int8_times(monkeypatch):
    """time_pass answers from a table by whether the model has int8 layers; counts calls."""
    from accel.kernels.quant import is_int8

    times = {"float": 10.0, "int8": 5.0, "calls": 0}

    def fake(model, cache, tokens, repeats, warmup=1):
        times["calls"] += 1
        return [times["int8" if is_int8(model) else "float"]] * repeats

    monkeypatch.setattr(timing, "time_pass", fake)
    monkeypatch.setattr(calibrate, "_INT8", type(calibrate._INT8)())
    return times


@pytest.mark.parametrize("int8_ms, expected", [(5.0, True), (20.0, False)])
def test_prefer_int8_measures_once_then_reads_the_cache(calib_cache, fake_int8_times, int8_ms, expected):
    model = make_tiny_model()
    fake_int8_times["int8"] = int8_ms
    assert calibrate.prefer_int8(model) is expected
    measured = fake_int8_times["calls"]
    assert measured >= 2
    from accel.kernels import quant
    assert (model in quant._COPIES) is expected  # a losing int8 copy is not kept
    files = [p for p in (calib_cache / "calibration").glob("*.json")]
    assert len(files) == 1 and json.loads(files[0].read_text())["int8_ms"] == int8_ms
    assert calibrate.prefer_int8(model) is expected and fake_int8_times["calls"] == measured  # kept in memory
    calibrate._INT8.clear()
    fake_int8_times["int8"] = 10.0 * 4  # a new measurement would now say the opposite of a win
    assert calibrate.prefer_int8(make_tiny_model()) is expected and fake_int8_times["calls"] == measured  # the file
    assert calibrate.prefer_int8(model, force=True) is False and fake_int8_times["calls"] > measured


def test_prefer_int8_is_off_without_calibration_or_off_a_float32_cpu_model(calib_cache, fake_int8_times, monkeypatch):
    assert calibrate.prefer_int8(make_tiny_model().to(torch.bfloat16)) is False
    monkeypatch.setenv("ACCEL_CALIBRATION", "off")
    assert calibrate.prefer_int8(make_tiny_model()) is False
    assert fake_int8_times["calls"] == 0


@pytest.mark.parametrize("int8_ms, expected", [(5.0, True), (20.0, False)])
def test_auto_quantize_drafts_in_int8_where_it_measured_faster(calib_cache, fake_int8_times, int8_ms, expected):
    from accel.kernels.quant import is_int8
    from speculative import DraftModel

    target, draft = make_tiny_model(seed=1), make_tiny_model(seed=2)
    fake_int8_times["int8"] = int8_ms
    assert is_int8(DraftModel(model=draft).resolve(target)[0]) is expected
    assert is_int8(DraftModel(model=draft, quantize="int8").resolve(target)[0])
    assert not is_int8(DraftModel(model=draft, quantize="none").resolve(target)[0])
    assert not is_int8(draft)  # the loaded model is never changed


def test_split_kernels_take_the_fewest_tokens_where_they_beat_every_other_choice():
    tokens = (1, 2, 8, 32)
    plain, packed = (10.0, 12.0, 20.0, 40.0), (9.0, 9.5, 15.0, 30.0)

    def with_split(split, second=None, transposed=(11.0, 13.0, 22.0, 44.0)):
        grids = {"plain": (plain,) * (2 if second else 1), "transposed": (transposed,) * (2 if second else 1),
                 "packed": (packed,) * (2 if second else 1), "split": (tuple(split),) + ((tuple(second),) if second else ())}
        return table(tokens, [1.0, 2.0, 3.0, 4.0], cache_lens=(256, 2048)[: 2 if second else 1],
                     kernel_tokens=tokens, kernel_ms=grids)

    # the AMD EPYC (Zen 3)'s shape: one bmm over the weight's halves wins for one token only
    zen3 = with_split([7.0, 10.0, 18.0, 35.0])
    assert zen3.split_rows == 1 and zen3.packed_rows == (1, None)
    assert zen3.kernels == "split for 1 token, packed otherwise"
    assert chosen_kernels(tokens, "plain", zen3.packed_rows, zen3.split_rows) == ["split", "packed", "packed", "packed"]
    assert with_split([7.0, 9.0, 18.0, 35.0]).split_rows == 2  # a prefix of wins
    assert with_split([7.0, 10.0, 14.0, 35.0]).split_rows == 1  # a later lone win is not part of it
    assert with_split([9.5, 9.0, 14.0, 25.0]).split_rows == 0  # must win from the fewest tokens
    assert with_split([1.0, 1.0, 1.0, 1.0]).split_rows == 32 and with_split([1.0] * 4).kernels == "split for 1-32 tokens, packed otherwise"
    assert with_split([7.0, 10.0, 18.0, 35.0], second=[9.5, 10.0, 18.0, 35.0]).split_rows == 0  # every cache length
    # split kernels view row-major weights: none beside a column-major layout
    assert with_split([7.0, 10.0, 18.0, 35.0], transposed=(4.0, 5.0, 8.0, 15.0)).split_rows == 0
    assert split_rows(tokens, {"plain": (plain,)}) == 0 and static_table().split_rows == 0
    # a split prefix can make row-major weights the better layout (it is part of the choice)
    grids = {"plain": (plain,), "transposed": ((7.0, 12.5, 20.0, 40.0),), "split": ((5.0, 13.0, 25.0, 45.0),)}
    assert weight_layout(grids) == "plain" and weight_layout({k: grids[k] for k in ("plain", "transposed")}) == "transposed"
    # the grid a model runs: split passes where it splits
    assert zen3.run_with(False, (1, None), 1) is zen3
    assert zen3.run_with(False, (1, None)).ms == (packed,)
    assert zen3.run_with(False, (1, None), 2).ms == ((7.0, 10.0, 15.0, 30.0),)
    assert zen3.run_with(False, None).ms == (plain,)


@pytest.mark.skipif(not prepack_supported(), reason="no oneDNN packing")
@pytest.mark.parametrize("split, expected", [((), 0), ((1,), 1), ((1, 8), 8), ((8,), 0)])
def test_auto_prepack_applies_the_split_window_of_the_table(calib_cache, monkeypatch, split, expected):
    from accel.calibration.calibrate import step_costs
    from accel.kernels.cpu import split_rows as model_split_rows

    monkeypatch.setattr(timing, "measure", fake_measure(packed=(1, 8, 64), split=split))
    reference = make_tiny_model()
    model = prepacked(make_tiny_model(), "auto")
    assert model_split_rows(model) == expected
    assert step_costs(model) == calibrate.cost_table(model)  # it runs the kernels measured fastest
    if expected:  # drafts are sized by the kernels a model runs: without the split window, packed ones
        assert step_costs(prepack(make_tiny_model())).ms == ((1.0, 1.0, 1.0),)
    ids = torch.tensor([[4, 8, 15, 16, 23]])
    with torch.inference_mode():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=1e-4, atol=1e-5)


def test_passes_are_timed_as_verify_runs_them_with_ordered_attention_where_the_engine_uses_it(monkeypatch):
    # bf16 verify passes run ordered attention (accel.kernels.ordered), which costs a tree more
    # than sdpa: the cost table must time that, not sdpa, or drafts are sized too large
    from accel.kernels import invariance, ordered

    model = make_tiny_model(seed=3).to(torch.bfloat16)
    calls = []
    attend = ordered.attend
    monkeypatch.setattr(ordered, "attend", lambda *a, **k: calls.append(a[0].shape[2]) or attend(*a, **k))
    for uses_ordered in (False, True):
        monkeypatch.setattr(invariance, "ordered", lambda m, on=uses_ordered: on)
        cache = timing.filled_cache(model, 70)
        calls.clear()
        times = timing.time_pass(model, cache, 4, repeats=2)
        assert len(times) == 2 and cache.physical_length(0) == 70  # rolled back
        assert (len(calls) > 0) == uses_ordered
        assert set(calls) <= {4}
