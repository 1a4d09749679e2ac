"""Medusa heads: exactness of decoding with them, files (ours and the official format), trees."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

import accel
from accel.strategy import DraftContext, StrategyError, build_strategy
from helpers import (TINY_HIDDEN, TINY_VOCAB, alone_tokens, generate_alone, make_tiny_model, random_heads,
                     repetitive_prompt)
from snapkv import SnapKV
from speculative import Medusa, MedusaHeads
from speculative.medusa import CONFIG_NAME, DEFAULT_HEADS_DIR, WEIGHTS_NAME, load_heads
from speculative.medusa.trees import (
    MC_SIM_7B_63,
    TREES,
    build_tree,
    check_paths,
    expected_acceptance,
    rank_accuracies,
    tree_arrays,
    truncate_paths,
)

HIDDEN = TINY_HIDDEN


# --------------------------------------------------------------------------- exactness


@pytest.mark.parametrize("sequential", [False, True])
@pytest.mark.parametrize("compressed", [False, True])
@pytest.mark.parametrize("tree", ["auto", "dynamic", "mc_sim_7b_63", "chain", ((0,), (1,), (0, 0), (0, 1), (0, 0, 0))])
def test_greedy_output_is_unchanged_by_medusa(tmp_path, compressed, tree, sequential):
    model = make_tiny_model(seed=21)
    ids = repetitive_prompt(1, 48)
    base = [SnapKV(budget=16, window=4, kernel=3)] if compressed else []
    random_heads(seed=1, sequential=sequential).save_pretrained(tmp_path)
    ref = generate_alone(model, ids, 30, base)
    out = generate_alone(model, ids, 30, base + [Medusa(heads=str(tmp_path), tree=tree, max_nodes=12)])
    assert torch.equal(out.sequences, ref.sequences)
    assert out.stats.drafted_tokens > 0


def test_compressed_reference_differs_from_full():
    # the SnapKV case above is a real test only if compression changes the output
    model = make_tiny_model(seed=21)
    ids = repetitive_prompt(1, 48)
    assert not torch.equal(generate_alone(model, ids, 30).sequences,
                           generate_alone(model, ids, 30, [SnapKV(budget=16, window=4, kernel=3)]).sequences)


@pytest.mark.parametrize("sequential", [False, True])
@pytest.mark.parametrize("head_dtype", ["float32", "bfloat16", "model"])
def test_identity_heads_accept_on_repetitive_output_and_stay_exact(tmp_path, head_dtype, sequential):
    # Fresh heads are the identity: every head proposes the base model's next-token choice
    # at the last verified position, the token it just chose, again. This prompt's output
    # repeats one token 26 times, so those drafts are right there and tokens get accepted.
    model = make_tiny_model(seed=22)
    ids = repetitive_prompt(10, 40)
    MedusaHeads(3, HIDDEN, TINY_VOCAB, sequential=sequential).save_pretrained(tmp_path)
    ref = generate_alone(model, ids, 40)
    out = generate_alone(model, ids, 40, [Medusa(heads=str(tmp_path), head_dtype=head_dtype)])
    assert torch.equal(out.sequences, ref.sequences)
    assert out.stats.drafted_tokens > 0 and out.stats.accepted_tokens > 0


def test_medusa_composes_with_other_drafters_and_sampling(tmp_path):
    from speculative import PromptLookup

    model = make_tiny_model(seed=23)
    ids = repetitive_prompt(3, 40)
    random_heads(seed=3).save_pretrained(tmp_path)
    medusa = Medusa(heads=str(tmp_path), max_nodes=6)
    ref = generate_alone(model, ids, 25)
    out = generate_alone(model, ids, 25, [PromptLookup(num_tokens=4), medusa])
    assert torch.equal(out.sequences, ref.sequences)
    # top_k=1 makes sampling a point mass: lossless sampling must reproduce greedy output
    sampled = accel.generate(model, ids, strategies=[medusa], max_new_tokens=25, temperature=1.0, top_k=1, seed=0,
                             eos_token_id=[])
    assert torch.equal(sampled.sequences, ref.sequences)


def test_propose_builds_the_tree_from_head_top_tokens(tmp_path):
    model = make_tiny_model(seed=24)
    heads = random_heads(seed=4)
    heads.save_pretrained(tmp_path)
    paths = ((0,), (1,), (0, 0), (0, 1), (0, 0, 0))
    drafter = Medusa(heads=str(tmp_path), tree=paths, head_dtype="float32")
    state = drafter.start(model, torch.tensor([5, 6, 7]))
    h = torch.randn(HIDDEN, generator=torch.Generator().manual_seed(0))
    prop = drafter.propose(state, DraftContext(tokens=torch.tensor([5, 6, 7]), hidden=h, max_tokens=32))
    with torch.no_grad():
        top = heads(h, model.get_output_embeddings()).topk(2, dim=-1).indices  # [K, 2]
    assert prop.tokens.tolist() == [int(top[0, 0]), int(top[0, 1]), int(top[1, 0]), int(top[1, 1]), int(top[2, 0])]
    assert prop.parents.tolist() == [0, 0, 1, 1, 3]
    # the engine's budget truncates the tree to a parent-closed prefix
    small = drafter.propose(state, DraftContext(tokens=torch.tensor([5, 6, 7]), hidden=h, max_tokens=3))
    assert small.tokens.tolist() == prop.tokens.tolist()[:3] and small.parents.tolist() == [0, 0, 1]


def test_sequential_heads_draft_each_node_from_its_own_path(tmp_path):
    model = make_tiny_model(seed=25)
    heads = random_heads(seed=7, sequential=True, num_layers=2)
    with torch.no_grad():  # the tiny model's embeddings are small: make the path matter
        for head in heads.heads:
            head.blocks[0].linear.weight[:, HIDDEN:] *= 50
    heads.save_pretrained(tmp_path)
    paths = ((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (2,))
    drafter = Medusa(heads=str(tmp_path), tree=paths, head_dtype="float32", max_nodes=len(paths))
    state = drafter.start(model, torch.tensor([5, 6, 7]))
    h = torch.randn(HIDDEN, generator=torch.Generator().manual_seed(1))
    prop = drafter.propose(state, DraftContext(tokens=torch.tensor([5, 6, 7]), hidden=h, max_tokens=32))
    assert prop.parents.tolist() == [0, 0, 1, 1, 2, 3, 0]
    # brute force: node i's token is the rank-paths[i][-1] token of head len(paths[i]),
    # reading the embeddings of the root (7) and of the drafted tokens above the node
    emb = model.get_input_embeddings().weight
    lm = model.get_output_embeddings()
    tokens = {(): 7}
    for path, got in zip(paths, prop.tokens.tolist()):
        chain = [tokens[path[:j]] for j in range(len(path))]
        k = len(path)
        pad = chain + [0] * (heads.num_heads - k)  # the heads past k do not read these
        with torch.no_grad():
            logits = heads(h, lm, path_emb=emb[torch.tensor(pad)])[k - 1]
        assert got == int(logits.topk(path[-1] + 1).indices[path[-1]]), path
        tokens[path] = got
    # the drafts depend on the path: other roots change what the heads propose
    others = [drafter.propose(state, DraftContext(tokens=torch.tensor([5, 6, r]), hidden=h, max_tokens=32)).tokens
              for r in range(8, 40)]
    assert any(not torch.equal(o, prop.tokens) for o in others)


@pytest.mark.parametrize("sequential", [False, True])
def test_dynamic_tree_verifies_the_most_probable_paths(tmp_path, sequential):
    model = make_tiny_model(seed=26)
    heads = random_heads(seed=8, sequential=sequential, std=4.0)  # peaked: sure at some nodes, not at others
    if sequential:
        with torch.no_grad():  # make the path matter
            for head in heads.heads:
                head.blocks[0].linear.weight[:, HIDDEN:] *= 50
    heads.save_pretrained(tmp_path)
    n = 5  # within the beam and width, so the tree is the exact top n over every path
    drafter = Medusa(heads=str(tmp_path), tree="dynamic", head_dtype="float32", max_nodes=n)
    state = drafter.start(model, torch.tensor([5, 6, 7]))
    h = torch.randn(HIDDEN, generator=torch.Generator().manual_seed(2))
    prop = drafter.propose(state, DraftContext(tokens=torch.tensor([5, 6, 7]), hidden=h, max_tokens=32))
    assert len(prop) == n
    parents = prop.parents.tolist()
    assert max(parents) > 0 and parents.count(0) > 1  # deep where the heads are sure, wide where not
    assert all(0 <= p <= i for i, p in enumerate(parents))  # topologically ordered
    paths = []
    for i, p in enumerate(parents):
        paths.append((paths[p - 1] if p else ()) + (int(prop.tokens[i]),))

    # brute force: the log-probability of every token path the heads can draft, 3 deep
    emb, lm = model.get_input_embeddings().weight, model.get_output_embeddings()

    def log_probs(path: tuple[int, ...]) -> torch.Tensor:
        k = len(path)
        pad = [7, *path] + [0] * (heads.num_heads - k - 1)
        with torch.no_grad():
            logits = heads(h, lm, path_emb=emb[torch.tensor(pad)] if sequential else None)[k]
        return torch.log_softmax(logits.float(), dim=-1)

    value: dict[tuple[int, ...], float] = {}
    frontier = [((), 0.0)]
    for _ in range(heads.num_heads):
        nxt = []
        for path, v in frontier:
            lp = log_probs(path)
            for t in lp.topk(n).indices.tolist():
                value[path + (t,)] = v + float(lp[t])
                nxt.append((path + (t,), value[path + (t,)]))
        frontier = nxt
    best = sorted(value, key=value.get, reverse=True)[:n]
    assert sorted(paths) == sorted(best)
    got = [value[p] for p in paths]
    assert got == sorted(got, reverse=True)  # most probable first
    # a budget below max_nodes keeps the best nodes
    small = drafter.propose(state, DraftContext(tokens=torch.tensor([5, 6, 7]), hidden=h, max_tokens=2))
    assert small.tokens.tolist() == prop.tokens.tolist()[:2]


@pytest.mark.parametrize("sequential", [False, True])
def test_a_batch_of_rows_drafts_the_trees_each_row_drafts_alone(tmp_path, sequential):
    """propose_batch (every head once over all rows' paths) gives each row the tree it gets
    alone, at full budget and at smaller ones; rows without budget get none."""
    model = make_tiny_model(seed=26)
    random_heads(seed=9, sequential=sequential, std=2.0).save_pretrained(tmp_path)
    drafter = Medusa(heads=str(tmp_path), tree="dynamic", head_dtype="float32", max_nodes=12)
    gen = torch.Generator().manual_seed(3)
    budgets = [12, 12, 3, 0, 12, 1]
    states = [drafter.start(model, torch.tensor([5, 6, 7])) for _ in budgets]
    ctxs = [DraftContext(tokens=torch.tensor([5, 6, 8 + r]), hidden=torch.randn(HIDDEN, generator=gen), max_tokens=n)
            for r, n in enumerate(budgets)]
    together = drafter.propose_batch(states, ctxs)
    assert len(together) == len(budgets)
    for state, ctx, got in zip(states, ctxs, together):
        alone = drafter.propose(state, ctx)
        if ctx.max_tokens == 0:
            assert got is None and alone is None
            continue
        assert len(got) == ctx.max_tokens
        if ctx.max_tokens == 12:  # the same width and beam: the very same tree
            assert got.tokens.tolist() == alone.tokens.tolist() and got.parents.tolist() == alone.parents.tolist()
        else:  # a wider search for the batch's largest budget finds the same best nodes
            assert sorted(got.tokens.tolist()) == sorted(alone.tokens.tolist())
    rows = [tuple(t.tokens.tolist()) for t in together if t is not None]
    assert len(set(rows)) > 1  # the rows' hidden states matter


def test_a_batch_drafts_medusa_in_one_call_and_stays_exact(tmp_path, monkeypatch):
    model = make_tiny_model(seed=27)
    random_heads(seed=10, std=1.0).save_pretrained(tmp_path)
    drafter = Medusa(heads=str(tmp_path), tree="dynamic", head_dtype="float32")
    prompts = [repetitive_prompt(s, n)[0] for s, n in ((1, 20), (2, 33), (3, 9), (4, 41))]
    alone = [alone_tokens(model, p, 24, [drafter]) for p in prompts]
    calls = []
    real = Medusa.propose_batch
    monkeypatch.setattr(Medusa, "propose_batch", lambda self, states, ctxs: calls.append(len(states)) or real(self, states, ctxs))
    out = accel.generate(model, list(prompts), strategies=[drafter], max_new_tokens=24, eos_token_id=[])
    assert calls and max(calls) == len(prompts)  # all rows drafted in one call
    for b, p in enumerate(prompts):
        assert out.sequences[b, -24:].tolist() == alone[b]


def test_dynamic_tree_is_a_valid_tree_value():
    assert Medusa(tree="dynamic").tree == "dynamic"
    with pytest.raises(ValueError, match="'dynamic'"):
        Medusa(tree="dynamik")


def test_propose_without_hidden_is_a_clear_error(tmp_path):
    random_heads().save_pretrained(tmp_path)
    drafter = Medusa(heads=str(tmp_path))
    state = drafter.start(make_tiny_model(), torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="hidden state"):
        drafter.propose(state, DraftContext(tokens=torch.tensor([1, 2]), hidden=None, max_tokens=8))


def test_one_residual_block_definition_serves_the_modules_and_the_packed_heads(tmp_path):
    from speculative.medusa.heads import residual_block

    # golden: x + SiLU(W x + b), and with a path x + SiLU(W [x; e_1] + b), on hand-made tensors
    x = torch.tensor([1.0, -2.0])
    w, b = torch.tensor([[1.0, 0.0], [0.0, 0.0]]), torch.tensor([0.0, 1.0])
    assert torch.equal(residual_block(x, lambda v: v @ w.T + b), x + torch.nn.functional.silu(torch.tensor([1.0, 1.0])))
    w_path = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 1.0]])  # reads e_1 only
    e = torch.tensor([[3.0, 4.0]])
    assert torch.equal(residual_block(x, lambda v: v @ w_path.T, e), x + torch.nn.functional.silu(e[0]))
    # the packed independent heads (one batched matmul per layer) compute what the modules do
    heads = random_heads(num_layers=2, seed=11)
    heads.save_pretrained(tmp_path)
    h = torch.randn(HIDDEN, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(load_heads(str(tmp_path)).packed.hidden(h, heads.num_heads), heads.hidden(h))


# --------------------------------------------------------------------------- files


@pytest.mark.parametrize("own_lm_head,sequential", [(False, False), (True, False), (False, True), (True, True)])
def test_save_load_round_trip(tmp_path, own_lm_head, sequential):
    heads = random_heads(num_heads=2, num_layers=2, own_lm_head=own_lm_head, seed=5, sequential=sequential)
    heads.info = {"base_model": "tiny", "topk_accuracy": [[0.5] * 10, [0.25] * 10]}
    heads.save_pretrained(tmp_path)
    assert {p.name for p in tmp_path.iterdir()} == {WEIGHTS_NAME, CONFIG_NAME}
    cfg = json.loads((tmp_path / CONFIG_NAME).read_text())
    assert cfg["num_heads"] == 2 and cfg["num_layers"] == 2 and cfg["hidden_size"] == HIDDEN
    assert cfg["vocab_size"] == TINY_VOCAB and cfg["own_lm_head"] is own_lm_head and cfg["base_model"] == "tiny"
    assert cfg["sequential"] is sequential
    back = MedusaHeads.from_pretrained(tmp_path)
    assert back.sequential is sequential and back.info["topk_accuracy"] == heads.info["topk_accuracy"]
    for (k1, v1), (k2, v2) in zip(heads.state_dict().items(), back.state_dict().items()):
        assert k1 == k2 and torch.equal(v1, v2)
    lm = make_tiny_model().get_output_embeddings()
    h = torch.randn(3, HIDDEN)
    path = torch.randn(3, 2, HIDDEN) if sequential else None
    with torch.no_grad():
        assert torch.equal(heads(h, lm, path_emb=path), back(h, lm, path_emb=path))
    if sequential:  # the same weights read as independent heads: a shape mismatch, named
        cfg["sequential"] = False
        (tmp_path / CONFIG_NAME).write_text(json.dumps(cfg))
        with pytest.raises(ValueError, match="has shape .* independent heads"):
            MedusaHeads.from_pretrained(tmp_path)


def test_save_in_bfloat16_loads_back_close(tmp_path):
    heads = random_heads(seed=6)
    heads.save_pretrained(tmp_path, dtype=torch.bfloat16)
    back = MedusaHeads.from_pretrained(tmp_path)
    for v1, v2 in zip(heads.state_dict().values(), back.state_dict().values()):
        assert v2.dtype == torch.float32
        torch.testing.assert_close(v1, v2, rtol=1e-2, atol=1e-2)


def test_medusa_from_pretrained_and_config_forms(tmp_path):
    random_heads().save_pretrained(tmp_path)
    drafter = Medusa.from_pretrained(tmp_path, max_nodes=8)
    assert drafter.heads == str(tmp_path.resolve()) and drafter.max_nodes == 8
    assert build_strategy(drafter.spec()) == drafter
    explicit = Medusa(tree=[[0], [0, 0]])
    assert explicit.spec()["tree"] == [[0], [0, 0]] and build_strategy(explicit.spec()) == explicit
    import yaml

    assert build_strategy(yaml.safe_load(yaml.safe_dump(explicit.spec()))) == explicit
    assert build_strategy({"name": "medusa", "heads": str(tmp_path), "tree": [[0], [0, 0], [1]]}).tree == ((0,), (0, 0), (1,))
    assert build_strategy("medusa:max_nodes=4,tree=chain").max_nodes == 4
    with pytest.raises(StrategyError, match="medusa.tree"):
        build_strategy({"name": "medusa", "tree": "no_such_tree"})
    with pytest.raises(StrategyError, match="parent"):
        build_strategy({"name": "medusa", "tree": [[0, 0]]})
    with pytest.raises(StrategyError, match="max_nodes"):
        build_strategy("medusa:max_nodes=0")


def _official_modules(num_heads: int, num_layers: int, hidden: int, vocab: int, seed: int) -> nn.ModuleList:
    """Heads laid out as the official Medusa code lays them out: per head an nn.Sequential of
    residual blocks (a ``linear`` each) and a final bias-free vocabulary projection."""

    class OfficialResBlock(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(hidden, hidden)
            self.act = nn.SiLU()

        def forward(self, x):
            return x + self.act(self.linear(x))

    torch.manual_seed(seed)
    mods = nn.ModuleList(
        nn.Sequential(*[OfficialResBlock() for _ in range(num_layers)], nn.Linear(hidden, vocab, bias=False))
        for _ in range(num_heads)
    )
    with torch.no_grad():
        for p in mods.parameters():
            p.normal_(0, 0.3)
    return mods


def _write_official(folder: Path, mods: nn.ModuleList, num_heads: int, num_layers: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(mods.state_dict(), folder / "medusa_lm_head.pt")
    (folder / "config.json").write_text(json.dumps({
        "medusa_num_heads": num_heads, "medusa_num_layers": num_layers, "base_model_name_or_path": "tiny-llama",
    }))


@pytest.mark.parametrize("num_layers", [1, 2])
def test_official_format_checkpoint_loads_with_identical_outputs(tmp_path, num_layers):
    mods = _official_modules(3, num_layers, HIDDEN, TINY_VOCAB, seed=7)
    _write_official(tmp_path, mods, 3, num_layers)
    heads = MedusaHeads.from_pretrained(tmp_path)  # detects the official format
    assert heads.own_lm_head and heads.num_heads == 3 and heads.num_layers == num_layers
    assert heads.info["base_model"] == "tiny-llama"
    h = torch.randn(5, HIDDEN)
    with torch.no_grad():
        expected = torch.stack([m(h) for m in mods], dim=-2)
        torch.testing.assert_close(heads(h), expected, rtol=0, atol=0)
    # and it drafts, exactly, through the engine (own output layers, no shared lm_head)
    model = make_tiny_model(seed=25)
    ids = repetitive_prompt(5, 40)
    ref = generate_alone(model, ids, 30)
    out = generate_alone(model, ids, 30, [Medusa(heads=str(tmp_path), max_nodes=8)])
    assert torch.equal(out.sequences, ref.sequences) and out.stats.drafted_tokens > 0
    # re-saved in our format, it loads back the same
    heads.save_pretrained(tmp_path / "ours")
    again = MedusaHeads.from_pretrained(tmp_path / "ours")
    with torch.no_grad():
        torch.testing.assert_close(again(h), expected, rtol=0, atol=0)


def test_vocab_subset_round_trip_and_drafts_only_from_it(tmp_path):
    subset = torch.tensor([3, 5, 8, 13, 21, 34, 55, 89])
    heads = random_heads(seed=10)
    heads.set_vocab_subset(subset.flip(0))  # any order; kept sorted
    assert heads.vocab_subset.tolist() == subset.tolist()
    heads.save_pretrained(tmp_path)
    assert json.loads((tmp_path / CONFIG_NAME).read_text())["vocab_subset_size"] == 8
    back = MedusaHeads.from_pretrained(tmp_path)
    assert back.vocab_subset.tolist() == subset.tolist()
    model = make_tiny_model(seed=26)
    lm = model.get_output_embeddings()
    h = torch.randn(4, HIDDEN)
    with torch.no_grad():
        logits = back(h, lm)
    outside = torch.ones(TINY_VOCAB, dtype=torch.bool)
    outside[subset] = False
    assert torch.isinf(logits[..., outside]).all() and torch.isfinite(logits[..., subset]).all()
    # the fast path drafts the same top tokens as the module
    drafter = Medusa(heads=str(tmp_path), tree=((0,), (1,), (0, 0), (0, 0, 0)), head_dtype="float32")
    state = drafter.start(model, torch.tensor([1]))
    prop = drafter.propose(state, DraftContext(tokens=torch.tensor([1]), hidden=h[0], max_tokens=8))
    top = logits[0].topk(2, dim=-1).indices
    assert prop.tokens.tolist() == [int(top[0, 0]), int(top[0, 1]), int(top[1, 0]), int(top[2, 0])]
    ids = repetitive_prompt(6, 40)
    assert torch.equal(generate_alone(model, ids, 30, [drafter]).sequences, generate_alone(model, ids, 30).sequences)


def test_bad_vocab_subset_is_a_clear_error(tmp_path):
    from safetensors.torch import load_file, save_file

    heads = random_heads()
    heads.set_vocab_subset(torch.tensor([1, 2, 3]))
    heads.save_pretrained(tmp_path)
    state = load_file(str(tmp_path / WEIGHTS_NAME))
    state["vocab_subset"] = torch.tensor([3, 2, 500])
    save_file(state, str(tmp_path / WEIGHTS_NAME))
    with pytest.raises(ValueError, match="'vocab_subset' must hold sorted, distinct token ids"):
        MedusaHeads.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="vocab_subset must hold token ids"):
        heads.set_vocab_subset(torch.tensor([TINY_VOCAB]))


# --------------------------------------------------------------------------- bad files


def _good(folder: Path) -> Path:
    random_heads(num_heads=2).save_pretrained(folder)
    return folder


def test_missing_folder_and_empty_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        MedusaHeads.from_pretrained(tmp_path / "nope")
    with pytest.raises(ValueError, match="holds no Medusa heads"):
        MedusaHeads.from_pretrained(tmp_path)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda c: c.pop("hidden_size"), "'hidden_size' must be"),
        (lambda c: c.update(num_heads="two"), "'num_heads' must be"),
        (lambda c: c.update(own_lm_head="yes"), "'own_lm_head' must be"),
        (lambda c: c.update(num_heads=3), "missing tensor 'heads.2"),
        (lambda c: c.update(num_heads=1), "unexpected tensor 'heads.1"),
        (lambda c: c.update(hidden_size=32), "has shape"),
        (lambda c: c.update(topk_accuracy=[[0.5]]), "'topk_accuracy'"),
    ],
)
def test_bad_config_is_a_clear_error(tmp_path, edit, message):
    folder = _good(tmp_path)
    cfg = json.loads((folder / CONFIG_NAME).read_text())
    edit(cfg)
    (folder / CONFIG_NAME).write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=message) as err:
        MedusaHeads.from_pretrained(folder)
    assert str(folder) in str(err.value)


def test_bad_weights_files_are_clear_errors(tmp_path):
    from safetensors.torch import load_file, save_file

    folder = _good(tmp_path)
    (folder / CONFIG_NAME).write_text("{not json")
    with pytest.raises(ValueError, match=f"{CONFIG_NAME}: not a readable JSON"):
        MedusaHeads.from_pretrained(folder)
    folder = _good(tmp_path / "b")
    (folder / WEIGHTS_NAME).write_bytes(b"garbage" * 10)
    with pytest.raises(ValueError, match=f"{WEIGHTS_NAME}: not a readable safetensors"):
        MedusaHeads.from_pretrained(folder)
    folder = _good(tmp_path / "c")
    state = load_file(str(folder / WEIGHTS_NAME))
    state["heads.0.blocks.0.linear.weight"] = torch.zeros(HIDDEN, HIDDEN + 1)
    save_file(state, str(folder / WEIGHTS_NAME))
    with pytest.raises(ValueError, match=r"'heads.0.blocks.0.linear.weight' has shape \(64, 65\), expected \(64, 64\)"):
        MedusaHeads.from_pretrained(folder)
    folder = _good(tmp_path / "d")
    (folder / WEIGHTS_NAME).unlink()
    with pytest.raises(FileNotFoundError, match=WEIGHTS_NAME):
        MedusaHeads.from_pretrained(folder)


def test_heads_for_another_model_are_refused_at_start(tmp_path):
    MedusaHeads(2, 32, TINY_VOCAB).save_pretrained(tmp_path / "hidden")
    MedusaHeads(2, HIDDEN, TINY_VOCAB + 3).save_pretrained(tmp_path / "vocab")
    model = make_tiny_model()
    with pytest.raises(ValueError, match="hidden size 32, but the model .* has hidden size 64"):
        Medusa(heads=str(tmp_path / "hidden")).start(model, torch.tensor([1]))
    with pytest.raises(ValueError, match="predict 100 tokens, but the model's vocabulary has 97"):
        Medusa(heads=str(tmp_path / "vocab")).start(model, torch.tensor([1]))
    with pytest.raises(ValueError, match="paths 4 deep but the heads .* are 2"):
        Medusa(heads=str(tmp_path / "hidden"), tree=[[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]]).paths_for(
            load_heads(str(tmp_path / "hidden")))


class _NotAllowed:  # a pickled class: torch.load(weights_only=True) must refuse it
    pass


def test_bad_official_files_are_clear_errors(tmp_path):
    mods = _official_modules(2, 1, HIDDEN, TINY_VOCAB, seed=8)
    _write_official(tmp_path / "a", mods, 2, 1)
    (tmp_path / "a" / "config.json").write_text(json.dumps({"medusa_num_layers": 1}))
    with pytest.raises(ValueError, match="'medusa_num_heads' must be"):
        MedusaHeads.from_pretrained(tmp_path / "a")
    _write_official(tmp_path / "b", mods, 3, 1)  # the config claims one head more than the file has
    with pytest.raises(ValueError, match=r"medusa_lm_head.pt: missing tensor '2.0.linear.weight'"):
        MedusaHeads.from_pretrained(tmp_path / "b")
    _write_official(tmp_path / "c", mods, 2, 2)  # wrong layer count
    with pytest.raises(ValueError, match="missing '0.2.weight'"):
        MedusaHeads.from_pretrained(tmp_path / "c")
    _write_official(tmp_path / "d", mods, 1, 1)  # fewer heads than the file
    with pytest.raises(ValueError, match="unexpected tensors"):
        MedusaHeads.from_pretrained(tmp_path / "d")
    _write_official(tmp_path / "e", mods, 2, 1)
    torch.save({"head": _NotAllowed()}, tmp_path / "e" / "medusa_lm_head.pt")
    with pytest.raises(ValueError, match=r"weights_only=True"):
        MedusaHeads.from_pretrained(tmp_path / "e")
    _write_official(tmp_path / "f", mods, 2, 1)
    torch.save([1, 2, 3], tmp_path / "f" / "medusa_lm_head.pt")
    with pytest.raises(ValueError, match="expected a state dict"):
        MedusaHeads.from_pretrained(tmp_path / "f")


def test_loaded_heads_are_cached_per_folder_dtype_and_device(tmp_path):
    random_heads().save_pretrained(tmp_path)
    a = load_heads(str(tmp_path))
    assert load_heads(str(tmp_path)) is a
    assert load_heads(str(tmp_path), dtype=torch.float64) is not a
    random_heads(seed=9).save_pretrained(tmp_path)  # rewritten: the cache notices
    assert not torch.equal(load_heads(str(tmp_path)).packed.weight, a.packed.weight)


# --------------------------------------------------------------------------- trees


def test_build_tree_picks_the_paths_with_the_highest_expected_acceptance():
    acc = [[0.6, 0.2, 0.1], [0.5, 0.2], [0.4]]
    # values: (0,) .6, (0,0) .3, (1,) .2, (0,1) .12 = (0,0,0) .12 (shallower first), (2,) .1, (1,0) .1
    assert build_tree(acc, 4) == ((0,), (0, 0), (1,), (0, 1))
    assert build_tree(acc, 7) == ((0,), (0, 0), (1,), (0, 1), (0, 0, 0), (2,), (1, 0))
    assert build_tree(acc, 0) == ()
    full = build_tree(acc, 100)  # every path of the 3 x 2 x 1 ranks
    assert len(full) == 3 + 3 * 2 + 3 * 2 * 1 and check_paths(full) == full
    # greedy: each prefix is the best tree of its size, and expected acceptance grows
    values = [expected_acceptance(full[:n], acc) for n in range(1, len(full) + 1)]
    assert values == sorted(values)
    assert expected_acceptance(build_tree(acc, 4), acc) == pytest.approx(0.6 + 0.3 + 0.2 + 0.12)


def test_rank_accuracies_from_cumulative_top_k():
    ranks = rank_accuracies([[0.5, 0.7, 0.8], [0.2, 0.2, 0.3]])
    assert ranks[0] == pytest.approx([0.5, 0.2, 0.1]) and ranks[1] == pytest.approx([0.2, 0.0, 0.1])


def test_named_trees_and_path_checks():
    assert len(MC_SIM_7B_63) == 63 and check_paths(MC_SIM_7B_63) == MC_SIM_7B_63
    assert max(len(p) for p in MC_SIM_7B_63) == 4 and "mc_sim_7b_63" in TREES
    assert truncate_paths(MC_SIM_7B_63, 5) == ((0,), (0, 0), (1,), (0, 1), (2,))
    assert truncate_paths(MC_SIM_7B_63, 6, max_depth=2) == ((0,), (0, 0), (1,), (0, 1), (2,), (1, 0))
    with pytest.raises(ValueError, match="parent"):
        check_paths([(0, 1)])
    with pytest.raises(ValueError, match="twice"):
        check_paths([(0,), (0,)])
    with pytest.raises(ValueError, match="negative"):
        check_paths([(-1,)])


def test_tree_arrays_give_tokens_and_parents():
    arrays = tree_arrays([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])
    assert arrays.parents.tolist() == [0, 0, 1, 1, 2, 3]
    top = torch.tensor([[10, 11], [20, 21], [30, 31]])
    assert arrays.tokens(top).tolist() == [10, 11, 20, 21, 20, 30]


# --------------------------------------------------------------------------- bfloat16


@pytest.mark.parametrize("sequential", [False, True])
@pytest.mark.parametrize("save_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tree", ["dynamic", "auto"])
def test_medusa_on_a_bfloat16_model_is_exact_and_accepts(tmp_path, tree, save_dtype, sequential):
    # heads stored in float32 or bfloat16 draft for a bfloat16 model: fresh (identity) heads
    # propose the base model's next token, which this model's output repeats
    model = make_tiny_model(seed=23).to(torch.bfloat16)
    ids = repetitive_prompt(2, 40)
    MedusaHeads(3, HIDDEN, TINY_VOCAB, sequential=sequential).save_pretrained(tmp_path, dtype=save_dtype)
    ref = generate_alone(model, ids, 40)
    out = generate_alone(model, ids, 40, [Medusa(heads=str(tmp_path), tree=tree, max_nodes=8)])
    assert torch.equal(out.sequences, ref.sequences)
    assert out.stats.accepted_tokens > 0


@pytest.mark.parametrize("head_dtype", ["auto", "float32", "bfloat16"])
def test_random_heads_on_a_bfloat16_model_stay_exact(tmp_path, head_dtype):
    model = make_tiny_model(seed=21).to(torch.bfloat16)
    ids = repetitive_prompt(1, 48)
    random_heads(seed=1, sequential=True).save_pretrained(tmp_path)
    ref = generate_alone(model, ids, 30)
    out = generate_alone(model, ids, 30, [Medusa(heads=str(tmp_path), head_dtype=head_dtype, max_nodes=12)])
    assert torch.equal(out.sequences, ref.sequences)
    assert out.stats.drafted_tokens > 0


@pytest.mark.parametrize("sequential", [False, True])
def test_bfloat16_drafts_are_valid_trees_of_the_heads_top_tokens(tmp_path, sequential):
    model = make_tiny_model(seed=26).to(torch.bfloat16)
    heads = random_heads(seed=11, sequential=sequential, std=4.0)
    heads.save_pretrained(tmp_path)
    h = torch.randn(HIDDEN, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    root = torch.tensor([5, 6, 7])
    lm = nn.Linear(HIDDEN, TINY_VOCAB, bias=False)
    with torch.no_grad():  # head 1's top token from the float32 module (ahead by > 1 logit here)
        lm.weight.copy_(model.get_output_embeddings().weight.float())
        emb = model.get_input_embeddings().weight.float()
        head1 = heads(h.float(), lm, path_emb=emb[torch.tensor([7, 0, 0])] if sequential else None)[0]
    static = ((0,), (1,), (0, 0), (0, 1), (0, 0, 0))
    for tree in ("dynamic", static):
        for head_dtype in ("auto", "float32", "bfloat16"):
            drafter = Medusa(heads=str(tmp_path), tree=tree, max_nodes=5, head_dtype=head_dtype)
            state = drafter.start(model, root)
            prop = drafter.propose(state, DraftContext(tokens=root, hidden=h, max_tokens=32))
            parents = prop.parents.tolist()
            assert len(prop) == 5 and all(0 <= p <= i for i, p in enumerate(parents))  # a tree, topologically ordered
            assert prop.tokens.dtype == torch.long and all(0 <= t < TINY_VOCAB for t in prop.tokens.tolist())
            if tree is static:
                assert parents == [0, 0, 1, 1, 3]
            assert int(prop.tokens[0]) == int(head1.argmax())  # both trees' first node: head 1's best token


def test_float32_heads_read_a_bfloat16_models_states():
    model = make_tiny_model(seed=24).to(torch.bfloat16)
    lm = nn.Linear(HIDDEN, TINY_VOCAB, bias=False)
    with torch.no_grad():
        lm.weight.copy_(model.get_output_embeddings().weight.float())
    h = torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    path = model.get_input_embeddings().weight[torch.tensor([[1, 2, 3]] * 3)]  # [3, K, H] bfloat16
    for heads, path_emb in ((random_heads(seed=4), None), (random_heads(seed=4, sequential=True), path),
                            (random_heads(seed=4, num_layers=0, own_lm_head=True), None)):
        with torch.no_grad():  # the blocks run in float32, the projection in the output layer's dtype
            got = heads(h, model.get_output_embeddings(), path_emb=path_emb)
            ref = heads(h.float(), lm, path_emb=path_emb.float() if path_emb is not None else None)
        assert got.dtype == (torch.float32 if heads.own_lm_head else torch.bfloat16)
        torch.testing.assert_close(got.float(), ref, atol=2e-2, rtol=2e-2)


# --------------------------------------------------------------------------- shipped heads


def test_shipped_default_heads_load_for_smollm2():
    if not (DEFAULT_HEADS_DIR / CONFIG_NAME).is_file():
        pytest.fail(f"no heads shipped in {DEFAULT_HEADS_DIR}")
    heads = MedusaHeads.from_pretrained("default")
    assert heads.hidden_size == 576 and heads.vocab_size == 49152 and not heads.own_lm_head
    assert heads.info["base_model"] == "SmolLM2-135M-Instruct"
    acc = heads.topk_accuracy
    assert acc is not None and len(acc) == heads.num_heads and all(len(r) == 10 for r in acc)
    assert sum(p.stat().st_size for p in DEFAULT_HEADS_DIR.iterdir()) < 8 * 2**20
    drafter = Medusa.from_pretrained("default")
    assert drafter.heads == "default" and drafter.tree == "dynamic"
    static = Medusa.from_pretrained("default", tree="auto")
    assert len(static.paths_for(load_heads("default"))) == static.max_nodes


@pytest.mark.real_model
def test_medusa_on_the_default_model_is_exact_and_accepts(default_model):
    from accel.models import chat_ids

    model, tokenizer = default_model
    # a held-out prompt (speculative/data/eval_prompts.txt), never trained on
    ids = chat_ids(tokenizer, "Write a Python function that counts the vowels in a string.")
    ref = accel.generate(model, ids, max_new_tokens=96, tokenizer=tokenizer)
    out = accel.generate(model, ids, strategies=[Medusa()], max_new_tokens=96, tokenizer=tokenizer)
    assert torch.equal(out.sequences, ref.sequences)
    assert out.stats.mean_accepted > 1.3
    wide = accel.generate(model, ids, strategies=[Medusa(max_nodes=32)], max_new_tokens=96, tokenizer=tokenizer)
    assert torch.equal(wide.sequences, ref.sequences)
    assert wide.stats.mean_accepted > 1.5


@pytest.mark.real_model
def test_medusa_with_snapkv_on_the_default_model_is_exact(default_model):
    from accel.models import chat_ids

    model, tokenizer = default_model
    text = " ".join(f"Item {i}: the {['red', 'blue', 'green'][i % 3]} box holds {i * 7} marbles." for i in range(60))
    ids = chat_ids(tokenizer, f"{text}\n\nHow many marbles does item 12 hold?")
    snap = SnapKV(budget=128, window=16, kernel=5)
    ref = accel.generate(model, ids, strategies=[snap], max_new_tokens=48, tokenizer=tokenizer)
    out = accel.generate(model, ids, strategies=[snap, Medusa()], max_new_tokens=48, tokenizer=tokenizer)
    assert torch.equal(out.sequences, ref.sequences)
    assert out.stats.kv_bytes_kept < out.stats.kv_bytes_full


def test_check_refuses_heads_for_another_model_before_any_work(tmp_path):
    from accel.strategy import Drafter
    from speculative import PromptLookup

    MedusaHeads(2, 32, TINY_VOCAB).save_pretrained(tmp_path / "hidden")
    MedusaHeads(2, HIDDEN, TINY_VOCAB + 3).save_pretrained(tmp_path / "vocab")
    random_heads(num_heads=2).save_pretrained(tmp_path / "good")
    model = make_tiny_model()
    with pytest.raises(ValueError, match="hidden size 32, but the model .* has hidden size 64"):
        Medusa(heads=str(tmp_path / "hidden")).check(model)
    with pytest.raises(ValueError, match="predict 100 tokens, but the model's vocabulary has 97"):
        Medusa(heads=str(tmp_path / "vocab")).check(model)
    with pytest.raises(ValueError, match="medusa.heads: .*does not exist"):
        Medusa(heads=str(tmp_path / "nope")).check(model)
    with pytest.raises(ValueError, match="holds no Medusa heads"):
        Medusa(heads=str(tmp_path)).check(model)
    with pytest.raises(ValueError, match="paths 3 deep but the heads .* are 2"):
        Medusa(heads=str(tmp_path / "good"), tree=[[0], [0, 0], [0, 0, 0]]).check(model)
    assert Medusa(heads=str(tmp_path / "good")).check(model) is None
    assert PromptLookup().check(model) is None  # the default hook accepts every model
    assert Drafter.check is PromptLookup.check
