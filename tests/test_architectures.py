"""Every architecture accel accepts, exact: tiny random models of each attention variant.

For each architecture (separate / biased / fused / interleaved query projections, per-head
and whole-projection q_norm, partial rotary, scaled and softcapped attention, sliding-window
layers):

- the window queries SnapKV captures equal the queries the model's own attention uses;
- plain ``accel.generate`` equals ``model.generate`` greedy;
- every speculative cell equals greedy decoding on the same (possibly compressed) cache,
  token for token;
- what accel cannot mirror is refused with a ValueError naming the model class.
"""

from __future__ import annotations

import functools
import math
import sys

import pytest
import torch
import transformers
from transformers.cache_utils import DynamicCache
from transformers.masking_utils import AttentionMaskInterface, eager_mask
from transformers.modeling_utils import AttentionInterface

import accel
from accel import adapter
from helpers import TINY_VOCAB, Scripted, random_heads, repetitive_prompt
from snapkv import AdaSnapKV, SnapKV, StreamingLLM
from speculative import Medusa, PromptLookup

HIDDEN = 64
NEW_TOKENS = 16
WINDOW = 8

_COMMON = dict(
    vocab_size=TINY_VOCAB,
    hidden_size=HIDDEN,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    bos_token_id=0,
    eos_token_id=1,
    pad_token_id=0,
    tie_word_embeddings=False,
)

#: name -> (config class, model class, config fields beyond _COMMON; None removes a field)
ARCHITECTURES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    "mistral_sliding": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 16}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),  # q/k/v projections with bias
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),  # per-head q_norm
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {
        "head_dim": 16, "sliding_window": 16, "query_pre_attn_scalar": 32,
        "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
    }),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {
        "head_dim": 16, "sliding_window": 16, "query_pre_attn_scalar": 32,
        "layer_types": ["sliding_attention", "full_attention"],
    }),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),  # fused qkv_proj
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),  # q_norm over the whole projection
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", {"num_key_value_heads": None}),  # interleaved, partial rotary
    "granite": ("GraniteConfig", "GraniteForCausalLM", {"attention_multiplier": 0.125}),
}
SLIDING = {"mistral_sliding", "gemma2", "gemma3"}


@functools.lru_cache(maxsize=None)
def arch_model(name: str, seed: int = 0):
    """A random tiny model of architecture ``name`` in eval mode, float32, on CPU.

    Biases and norm weights (every 1-D parameter) are perturbed away from transformers'
    zeros / ones init, so a missed bias or q_norm shows.
    """
    config_cls, model_cls, extra = ARCHITECTURES[name]
    fields = {**_COMMON, **extra}
    fields = {k: v for k, v in fields.items() if v is not None or k == "sliding_window"}
    config = getattr(transformers, config_cls)(**fields)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = getattr(transformers, model_cls)(config)
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 1:
                    p.add_(torch.randn_like(p) * 0.2)
    return model.to(torch.float32).eval()


def prompt(seed: int = 0, n: int = 60) -> torch.Tensor:
    """[1, n] ids: a 15-token segment repeated, so prompt lookup finds matches."""
    return repetitive_prompt(seed, n, period=15)


# --------------------------------------------------------------------------- window queries

_RECORD = "accel_test_record_queries"
_recorded: dict[int, torch.Tensor] = {}


def _recording_attention(module, query, key, value, attention_mask, **kwargs):
    """The model's own eager attention, remembering the first query each layer gets."""
    _recorded.setdefault(module.layer_idx, query.detach().clone())
    eager = sys.modules[type(module).__module__].eager_attention_forward
    return eager(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register(_RECORD, _recording_attention)
AttentionMaskInterface.register(_RECORD, eager_mask)


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_window_queries_are_the_queries_the_attention_uses(arch):
    model = arch_model(arch)
    ids = prompt(1)
    cache = DynamicCache(config=model.config)
    sink: dict[int, torch.Tensor] = {}
    saved = model.config._attn_implementation
    _recorded.clear()
    model.config._attn_implementation = _RECORD
    try:
        with torch.inference_mode(), adapter.capture_window_queries(model, cache, WINDOW, sink):
            positions = torch.arange(ids.shape[1]).unsqueeze(0)
            adapter.backbone_forward(model, ids, positions, cache)
    finally:
        model.config._attn_implementation = saved
    modules = adapter._attention_modules(model)
    assert sorted(sink) == sorted(_recorded) == list(range(len(modules)))
    for module in modules:
        i = module.layer_idx
        used = _recorded[i][:, :, -WINDOW:]  # [B, H_q, w, D] as the attention got them
        captured = sink[i]
        assert captured.shape == used.shape
        dim = used.shape[-1]
        # SnapKV scores q k^T / sqrt(D): the captured queries carry the layer's own scaling
        torch.testing.assert_close(captured / math.sqrt(dim), used * module.scaling)


def test_query_layouts_read_the_variants():
    layout = {a: adapter.query_layout(adapter._attention_modules(arch_model(a))[0], a) for a in ARCHITECTURES}
    assert layout["llama"].projection == "q_proj" and layout["llama"].norm is None and layout["llama"].scale == 1.0
    assert layout["qwen3"].norm == "head" and layout["gemma3"].norm == "head"
    assert layout["olmo2"].norm == "projection"
    assert layout["phi3"].projection == "qkv_proj"
    assert layout["gpt_neox"].projection == "query_key_value"
    assert layout["gemma2"].scale == pytest.approx(32**-0.5 * 4)
    assert layout["granite"].scale == pytest.approx(0.125 * 4)


def test_a_kernelized_rotary_function_is_called_as_the_module_and_read_through_it():
    # transformers >= 5.25 with the `kernels` package turns each modeling module's
    # apply_rotary_pos_emb into an nn.Module whose forward takes (*args, **kwargs)
    kernels = pytest.importorskip("kernels")

    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        return q, k

    wrapped = kernels.use_kernel_forward_from_hub("rotary_pos_emb")(apply_rotary_pos_emb)
    assert isinstance(wrapped, torch.nn.Module)
    assert adapter._kernelized_function(wrapped) is apply_rotary_pos_emb
    assert adapter._kernelized_function(apply_rotary_pos_emb) is apply_rotary_pos_emb

    def other(x, position_ids):
        return x

    attention = transformers.models.llama.modeling_llama.LlamaAttention
    module = sys.modules[attention.__module__]
    saved = module.apply_rotary_pos_emb
    try:
        module.apply_rotary_pos_emb = wrapped
        rope, why = adapter._rotary_function.__wrapped__(attention)  # uncached
        assert rope is wrapped and why == ""  # the model's own callable, so a kernel it runs is ours too
        module.apply_rotary_pos_emb = kernels.use_kernel_forward_from_hub("rotary_pos_emb")(other)
        rope, why = adapter._rotary_function.__wrapped__(attention)  # uncached
        assert rope is None and "(q, k, cos, sin)" in why
    finally:
        module.apply_rotary_pos_emb = saved


def _gpt2():
    config = transformers.GPT2Config(vocab_size=TINY_VOCAB, n_embd=HIDDEN, n_layer=2, n_head=4, n_positions=128)
    return transformers.GPT2LMHeadModel(config).eval()


def _opt():
    config = transformers.OPTConfig(vocab_size=TINY_VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, ffn_dim=128,
                                    num_attention_heads=4, word_embed_proj_dim=HIDDEN, max_position_embeddings=128)
    return transformers.OPTForCausalLM(config).eval()


@pytest.mark.parametrize("build,cls,missing", [
    (_gpt2, "GPT2LMHeadModel", "none of the query projections accel reads"),
    (_opt, "OPTForCausalLM", "takes no position_embeddings"),
])
def test_unmirrorable_attention_is_refused_before_the_prefill(build, cls, missing):
    model = build()
    with pytest.raises(ValueError, match=missing) as err:
        adapter.check_window_queries(model)
    assert cls in str(err.value)
    with pytest.raises(ValueError, match=missing):
        accel.generate(model, prompt(), strategies=[SnapKV(budget=24, window=WINDOW)], max_new_tokens=2,
                       eos_token_id=[])


# --------------------------------------------------------------------------- the matrix


@pytest.fixture(scope="module")
def heads_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("medusa_heads")
    random_heads(seed=0).save_pretrained(folder)  # (this file's own heads: non-sequential)
    return str(folder)


def _strategies(cell: str, heads: str, arch: str) -> list:
    from speculative import DraftModel

    make = {
        "draft_model": lambda: DraftModel(model=arch_model(arch, seed=1), num_tokens=4),
        "snapkv": lambda: SnapKV(budget=24, window=WINDOW, kernel=3),
        "ada_snapkv": lambda: AdaSnapKV(budget=24, window=WINDOW, kernel=3),
        "streaming_llm": lambda: StreamingLLM(sink=4, recent=20),
        "prompt_lookup": lambda: PromptLookup(),
        "medusa": lambda: Medusa(heads=heads, max_nodes=8, head_dtype="float32"),
    }
    return [make[part]() for part in cell.split("+")] if cell else []


_runs: dict[tuple[str, str], accel.GenerateResult] = {}


def run(arch: str, cell: str, heads: str):
    """accel.generate of ``arch`` with the strategies of ``cell`` ("a+b"; "" plain), memoised."""
    key = (arch, cell)
    if key not in _runs:
        _runs[key] = accel.generate(arch_model(arch), prompt(), strategies=_strategies(cell, heads, arch),
                                    max_new_tokens=NEW_TOKENS, eos_token_id=[])
    return _runs[key]


#: cell -> the cell whose output it must equal token for token ("" plain decoding)
CELLS = {
    "snapkv": None,
    "ada_snapkv": None,
    "streaming_llm": None,
    "prompt_lookup": "",
    "medusa": "",
    "snapkv+prompt_lookup": "snapkv",
    "snapkv+medusa": "snapkv",
    "ada_snapkv+prompt_lookup": "ada_snapkv",
    "streaming_llm+prompt_lookup": "streaming_llm",
    "draft_model": "",  # a random model of the same architecture drafts, on its own cache
    "snapkv+draft_model": "snapkv",
}

def _cases(cells):
    out = []
    for arch in sorted(ARCHITECTURES):
        for cell in cells:
            out.append(pytest.param(arch, cell, id=f"{arch}-{cell or 'plain'}"))
    return out


@pytest.mark.parametrize("arch,cell", _cases([""]))
def test_plain_equals_model_generate(arch, cell, heads_dir):
    model, ids = arch_model(arch), prompt()
    with torch.inference_mode():
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW_TOKENS,
                             eos_token_id=None, pad_token_id=0)  # None: no EOS, as accel's []
    assert torch.equal(run(arch, cell, heads_dir).sequences, ref)


@pytest.mark.parametrize("arch,cell", _cases(list(CELLS)))
def test_cell_is_exact(arch, cell, heads_dir):
    res = run(arch, cell, heads_dir)
    assert res.sequences.shape == (1, 60 + NEW_TOKENS)
    if cell.split("+")[0] in ("snapkv", "ada_snapkv", "streaming_llm"):
        assert res.stats.kv_bytes_kept < res.stats.kv_bytes_full  # the prompt was compressed
    if "prompt_lookup" in cell or "medusa" in cell or "draft_model" in cell:
        assert res.stats.drafted_tokens > 0
    reference = CELLS[cell]
    if reference is not None:
        assert res.sequences.tolist() == run(arch, reference, heads_dir).sequences.tolist()


# --------------------------------------------------------------------------- bfloat16


#: New tokens of 20 that drafting in bf16 must give exactly as plain bf16 decoding where
#: verification is labelled approximate (sliding windows, soft-capping): a last-bit difference
#: may flip a near-tie somewhere, not the start of the output.
APPROXIMATE_PREFIX = 10


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_bf16_drafting_is_exact_where_claimed_on_every_architecture(arch):
    # ordered attention wherever the attention allows it; claimed exact without sliding
    # windows and soft-capping, and then greedy drafting (garbage included) equals plain bf16;
    # labelled approximate otherwise, and then it agrees for APPROXIMATE_PREFIX new tokens
    import copy
    import warnings

    from accel.kernels import invariance, ordered

    model = copy.deepcopy(arch_model(arch)).to(torch.bfloat16)
    geo = adapter.geometry(model)
    capable = arch != "gemma2"  # attention logit soft-capping: not computed by ordered attention
    assert adapter.ordered_capable(model) == capable
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the approximate label, where it applies
        exact = invariance.is_exact(model)
    products = ordered.probe(geo.head_dim, geo.num_heads // geo.num_kv_heads)
    # exact needs a row count (verify_rows) at which the invariance probe passes
    invariant = invariance.probe(model, invariance.verify_rows(model), invariance.kv_align(model))
    assert exact == (capable and arch not in SLIDING and products and invariant)
    ids = prompt(3)
    kw = dict(max_new_tokens=20, eos_token_id=[])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        ref = accel.generate(model, ids, strategies=[], **kw)
        outs = [accel.generate(model, ids, strategies=s, **kw) for s in ([PromptLookup()], [Scripted(mode="random")])]
    for out in outs:
        assert out.stats.exact_verify == exact and out.stats.drafted_tokens > 0
        agree = ids.shape[1] + (kw["max_new_tokens"] if exact else APPROXIMATE_PREFIX)
        assert torch.equal(out.sequences[:, :agree], ref.sequences[:, :agree])
