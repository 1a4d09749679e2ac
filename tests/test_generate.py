"""accel.generate on tiny random Llama models: equality with model.generate, sampling, errors."""

import pytest
import torch

import accel
from accel import StrategyError
from helpers import left_padded, make_tiny_model, random_prompt


def hf_greedy(model, ids, max_new_tokens, eos=None):
    extra = {} if eos is None else {"eos_token_id": eos}  # None would switch the model's EOS off
    return model.generate(
        ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=0, **extra
    )


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("prompt_len,new", [(1, 5), (7, 20), (40, 33)])
def test_plain_decoding_equals_model_generate(seed, prompt_len, new):
    model = make_tiny_model(seed=seed)
    ids = random_prompt(seed + 100, prompt_len)
    ref = hf_greedy(model, ids, new)  # the model's own EOS, as in generation_config
    res = accel.generate(model, ids, strategies=[], max_new_tokens=new)
    assert torch.equal(res.sequences, ref)


def test_eos_stops_like_model_generate():
    model = make_tiny_model(seed=3)
    ids = random_prompt(7, 9)
    free = accel.generate(model, ids, max_new_tokens=30, eos_token_id=[])
    stop = int(free.sequences[0, 9 + 4])  # make the 5th generated token the EOS
    ref = hf_greedy(model, ids, 30, eos=stop)
    res = accel.generate(model, ids, max_new_tokens=30, eos_token_id=stop)
    assert torch.equal(res.sequences, ref)
    assert int(res.sequences[0, -1]) == stop
    assert res.stats.new_tokens == res.sequences.shape[1] - 9 <= 5


def test_stats_fields():
    model = make_tiny_model()
    ids = random_prompt(0, 12)
    res = accel.generate(model, ids, max_new_tokens=10, eos_token_id=[])
    s = res.stats
    for name in ("prefill_s", "decode_s", "new_tokens", "verify_steps", "mean_accepted", "kv_bytes_full", "kv_bytes_kept"):
        assert hasattr(s, name), name
    assert s.new_tokens == 10
    assert s.verify_steps == 9  # the first token comes from the prefill
    assert s.mean_accepted == 1.0
    # 2 layers * K,V * 2 kv heads * head_dim 16 * fp32, for the 21 tokens whose KV exists
    assert s.kv_bytes_full == s.kv_bytes_kept == 21 * 2 * 2 * 2 * 16 * 4
    assert "tok/s" in s.summary()


def test_sampling_is_reproducible_with_seed_and_varies_without():
    model = make_tiny_model()
    ids = random_prompt(1, 6)
    kw = dict(max_new_tokens=24, temperature=1.0, eos_token_id=[])
    a = accel.generate(model, ids, seed=5, **kw).sequences
    b = accel.generate(model, ids, seed=5, **kw).sequences
    c = accel.generate(model, ids, seed=6, **kw).sequences
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    greedy = accel.generate(model, ids, max_new_tokens=24, eos_token_id=[]).sequences
    assert not torch.equal(a, greedy)


def test_top_k_1_sampling_is_greedy():
    model = make_tiny_model(seed=4)
    ids = random_prompt(2, 6)
    greedy = accel.generate(model, ids, max_new_tokens=15, eos_token_id=[]).sequences
    sampled = accel.generate(model, ids, max_new_tokens=15, temperature=0.7, top_k=1, seed=0, eos_token_id=[]).sequences
    assert torch.equal(greedy, sampled)


def test_batch_rows_equal_single_rows_with_left_padding():
    model = make_tiny_model(seed=5)
    g = torch.Generator().manual_seed(3)
    a = torch.randint(2, 97, (5,), generator=g)
    b = torch.randint(2, 97, (8,), generator=g)
    batch, mask = left_padded([a, b])
    res = accel.generate(model, batch, attention_mask=mask, max_new_tokens=6, eos_token_id=[])
    one_a = accel.generate(model, a.unsqueeze(0), max_new_tokens=6, eos_token_id=[]).sequences[0]
    one_b = accel.generate(model, b.unsqueeze(0), max_new_tokens=6, eos_token_id=[]).sequences[0]
    assert res.sequences.shape == (2, 14)
    assert torch.equal(res.sequences[0, 3:], one_a)
    assert torch.equal(res.sequences[1], one_b)
    assert res.stats.new_tokens == 12


def test_a_list_of_rows_of_any_lengths_is_a_batch():
    model = make_tiny_model()
    rows = [torch.tensor([5, 6, 7, 8, 9]), [11, 12], torch.tensor([[13, 14, 15]])]
    res = accel.generate(model, rows, max_new_tokens=6, eos_token_id=[])
    for b, row in enumerate(rows):
        ids = torch.as_tensor(row).reshape(1, -1)
        alone = accel.generate(model, ids, max_new_tokens=6, eos_token_id=[]).sequences[0, ids.shape[1]:]
        assert res.sequences[b, -6:].tolist() == alone.tolist()
        assert res.row_stats[b].prompt_tokens == ids.shape[1]


def test_zero_new_tokens_returns_the_prompt():
    model = make_tiny_model()
    ids = torch.tensor([[5, 6, 7]])
    res = accel.generate(model, ids, max_new_tokens=0)
    assert torch.equal(res.sequences, ids) and res.stats.new_tokens == 0


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(inputs=torch.zeros(1, 0, dtype=torch.long)), "empty prompt"),
        (dict(inputs=""), "tokenizer"),
        (dict(max_new_tokens=-1), "max_new_tokens"),
        (dict(temperature=-0.5), "temperature"),
        (dict(top_p=1.5), "top_p"),
        (dict(inputs=torch.zeros(1, 3)), "integer"),
        (dict(inputs=[torch.tensor([3, 4]), torch.zeros(0, dtype=torch.long)]), r"inputs\[1\] has no tokens"),
        (dict(inputs=[[3, 4], [5, 6.5]]), r"inputs\[1\] must hold integer"),
        (dict(inputs=[torch.tensor([3, 4]), torch.ones(2, 2, dtype=torch.long)]), r"inputs\[1\] must be one row"),
        (dict(inputs=[[3, 4]], attention_mask=torch.ones(1, 2)), "needs none"),
    ],
)
def test_bad_input_gets_a_clear_error(kwargs, match):
    model = make_tiny_model()
    kwargs.setdefault("inputs", torch.tensor([[3, 4]]))
    with pytest.raises(ValueError, match=match):
        accel.generate(model, **kwargs)


def test_unknown_strategy_and_field_are_named():
    model = make_tiny_model()
    with pytest.raises(StrategyError, match="unknown strategy 'snapkb'"):
        accel.generate(model, torch.tensor([[3, 4]]), strategies=["snapkb"])
    with pytest.raises(StrategyError, match="windw"):
        accel.generate(model, torch.tensor([[3, 4]]), strategies=[{"name": "snapkv", "windw": 8}])
    with pytest.raises(StrategyError, match="budget"):
        accel.generate(model, torch.tensor([[3, 4]]), strategies=["snapkv:budget=-5"])


def test_model_that_is_not_a_causal_lm_is_refused():
    from transformers import LlamaConfig, LlamaModel

    base = LlamaModel(LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                  num_attention_heads=2, num_key_value_heads=2))
    with pytest.raises(ValueError, match="LlamaModel"):
        accel.generate(base, torch.tensor([[3, 4]]))
    with pytest.raises(ValueError, match="Linear"):
        accel.generate(torch.nn.Linear(2, 2), torch.tensor([[3, 4]]))
