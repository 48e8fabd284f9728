"""The decoding loop and sampling: per-row streams, padding and batch-mates that change nothing, stops, OOM halving."""

import inspect

import pytest
import torch

from phalanx.errors import PhalanxError
from phalanx.generate.engine import generate_rows, generate_with_fallback, stop_token_ids
from phalanx.generate.sampling import SamplingParams, next_tokens, row_seed, row_uniforms
from phalanx.generate.static_decode import StaticDecoder
from phalanx.models.load import load_model, load_tokenizer

MODEL = "embedded:tiny-qwen3"


@pytest.fixture(scope="module")
def tiny():
    tokenizer = load_tokenizer(MODEL)
    model = load_model(MODEL, torch.float32).eval()
    return model, tokenizer


def encode(tokenizer, question: str, system: str | None = None) -> list[int]:
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.fixture(scope="module")
def prompts(tiny):
    _, tok = tiny
    # Very different lengths, so the short ones sit behind a lot of left padding.
    return [
        encode(tok, "Hi?"),
        encode(tok, "What is a healthy resting heart rate for an adult?" * 3, "Be brief."),
        encode(tok, "BMI for 70 kg, 175 cm?"),
        encode(tok, "x" * 200),
    ]


@pytest.fixture(params=["growing", "fixed"])
def decoding(request):
    """Each decoding loop: the growing cache that finished rows leave, and the fixed-size one (CUDA graphs on CUDA)."""
    return request.param


def decoder_for(decoding: str):
    return StaticDecoder() if decoding == "fixed" else None


def run(model, tok, prompts, pairs, params, stops=None, decoder=None):
    distinct = sorted({p for p, _ in pairs})
    at = {p: i for i, p in enumerate(distinct)}
    return generate_rows(
        model,
        [prompts[p] for p in distinct],
        pairs,
        [at[p] for p, _ in pairs],
        params,
        stop_token_ids(tok, model.generation_config) if stops is None else stops,
        tok.pad_token_id,
        len(tok),
        decoder,
    )


# A two-layer decoder of another architecture, built from its config (no padding to draw, no EOS to stop at).
SMALL_DECODER = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=256,
    pad_token_id=0,
    bos_token_id=None,
    eos_token_id=None,
)


def seeded_model(model_class, config):
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return model_class(config).eval()


def assert_rows_as_hf_generate(model, prompts, row_prompt, rows):
    """Each greedy row is what HF `generate` continues its prompt with, alone."""
    for row, prompt in zip(rows, row_prompt):
        ids = torch.tensor([prompts[prompt]])
        reference = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=len(row.tokens),
            pad_token_id=0,
        )
        assert row.finish_reason == "length" and row.tokens == reference[0, ids.shape[1] :].tolist()


def test_row_seed_is_a_pure_function_of_seed_prompt_and_sequence():
    assert row_seed(1, 2, 3) == row_seed(1, 2, 3)
    assert len({row_seed(s, p, q) for s in range(3) for p in range(5) for q in range(5)}) == 75
    params = SamplingParams(max_new_tokens=5, seed=9)
    a = row_uniforms([(0, 0), (4, 2)], params)
    b = row_uniforms([(4, 2), (7, 7), (0, 0)], params)
    assert torch.equal(a[0], b[2]) and torch.equal(a[1], b[0])


def test_sampling_is_inverse_cdf_over_filtered_rows():
    logits = torch.log(torch.tensor([[0.1, 0.2, 0.3, 0.4, 1e-9, 1e-9]]))
    params = SamplingParams(temperature=1.0)
    u = torch.linspace(0, 0.999, 1000, dtype=torch.float64)
    draws = next_tokens(logits.expand(1000, -1), u, params, vocab_limit=4)
    counts = torch.bincount(draws, minlength=6).tolist()
    assert counts[4:] == [0, 0]  # beyond the tokenizer's vocabulary: never drawn
    assert [round(c / 1000, 1) for c in counts[:4]] == [0.1, 0.2, 0.3, 0.4]
    top2 = next_tokens(logits.expand(1000, -1), u, SamplingParams(temperature=1.0, top_k=2))
    assert set(top2.tolist()) == {2, 3}
    nucleus = next_tokens(logits.expand(1000, -1), u, SamplingParams(temperature=1.0, top_p=0.65))
    assert set(nucleus.tolist()) == {2, 3}  # 0.4 + 0.3 >= 0.65: the rest is cut
    assert next_tokens(logits, u[:1], SamplingParams(temperature=0)).item() == 3
    # A row's draw does not depend on the rows next to it.
    mixed = torch.cat([logits, torch.randn(3, 6)])
    assert (
        next_tokens(mixed, torch.tensor([0.5, 0.1, 0.2, 0.3], dtype=torch.float64), params)[0]
        == next_tokens(logits, torch.tensor([0.5], dtype=torch.float64), params)[0]
    )


def test_batch_mates_padding_and_shared_prefill_change_nothing(tiny, prompts, decoding):
    model, tok = tiny
    params = SamplingParams(max_new_tokens=24, temperature=1.0, top_p=0.95, top_k=50, seed=5)
    pairs = [(p, s) for p in range(len(prompts)) for s in range(3)]
    decoder = decoder_for(decoding)  # one decoder for every call: its buffers are reused across batch shapes
    together = run(model, tok, prompts, pairs, params, decoder=decoder)  # left-padded, 3 rows each share a prefill
    alone = [run(model, tok, prompts, [pair], params, decoder=decoder)[0] for pair in pairs]
    assert [r.tokens for r in run(model, tok, prompts, pairs, params, decoder=decoder)] == [r.tokens for r in together]
    assert [r.tokens for r in together] == [r.tokens for r in alone]
    assert [r.finish_reason for r in together] == [r.finish_reason for r in alone]
    # Sequences of one prompt differ (own streams); every row has tokens or stopped.
    assert len({tuple(r.tokens) for r in together[:3]}) == 3
    # A different seed gives different samples.
    other = run(
        model, tok, prompts, pairs, SamplingParams(max_new_tokens=24, temperature=1.0, top_p=0.95, top_k=50, seed=6)
    )
    assert [r.tokens for r in other] != [r.tokens for r in together]


def test_greedy_matches_hf_generate_with_left_padding(tiny, prompts, decoding):
    model, tok = tiny
    params = SamplingParams(max_new_tokens=12, temperature=0)
    ours = run(model, tok, prompts, [(0, 0), (1, 0), (3, 0)], params, stops=[], decoder=decoder_for(decoding))
    longest = max(len(prompts[i]) for i in (0, 1, 3))
    ids = torch.tensor([[tok.pad_token_id] * (longest - len(prompts[i])) + prompts[i] for i in (0, 1, 3)])
    mask = (torch.arange(longest) >= torch.tensor([longest - len(prompts[i]) for i in (0, 1, 3)])[:, None]).long()
    ref = model.generate(
        input_ids=ids,
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=12,
        min_new_tokens=12,
        pad_token_id=tok.pad_token_id,
        suppress_tokens=list(range(len(tok), model.config.vocab_size)),
    )
    assert [r.tokens for r in ours] == ref[:, longest:].tolist()
    assert all(r.finish_reason == "length" for r in ours)


def test_rows_stop_at_a_stop_token_and_leave_the_batch(tiny, prompts, decoding):
    model, tok = tiny
    params = SamplingParams(max_new_tokens=16, temperature=0)
    decoder = decoder_for(decoding)
    free = run(model, tok, prompts, [(0, 0), (2, 0)], params, stops=[], decoder=decoder)
    stop = free[0].tokens[5]
    first = free[0].tokens.index(stop)
    stopped = run(model, tok, prompts, [(0, 0), (2, 0)], params, stops=[stop], decoder=decoder)
    assert stopped[0].tokens == free[0].tokens[:first] and stopped[0].finish_reason == "stop"
    assert stopped[0].computed_tokens == first + 1
    # The other row goes on as before (until it meets the same token, if it does).
    cut = free[1].tokens.index(stop) if stop in free[1].tokens else len(free[1].tokens)
    assert stopped[1].tokens == free[1].tokens[:cut]
    assert stop_token_ids(tok, model.generation_config) == [tok.convert_tokens_to_ids("<|im_end|>")]


class OomAbove(torch.nn.Module):
    """The tiny model, but a forward pass with more than `limit` rows raises CUDA's out-of-memory error.

    No GPU exists here; torch.cuda.OutOfMemoryError is an ordinary exception class on CPU, so the
    halving path runs exactly as it would after a real CUDA allocation failure.
    """

    def __init__(self, model, limit: int):
        super().__init__()
        self.inner, self.limit, self.calls = model, limit, []
        self.config, self.generation_config = model.config, model.generation_config

    def forward(self, input_ids, **kwargs):
        self.calls.append(input_ids.shape[0])
        if input_ids.shape[0] > self.limit:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
        return self.inner(input_ids=input_ids, **kwargs)


def test_out_of_memory_halves_the_batch_and_keeps_the_results(tiny, prompts, decoding):
    model, tok = tiny
    params = SamplingParams(max_new_tokens=8, temperature=1.0, seed=3)
    pairs = [(p, s) for p in range(3) for s in range(3)]
    ids = dict(enumerate(prompts))
    stops = stop_token_ids(tok, model.generation_config)
    reference, size = generate_with_fallback(
        model, ids, pairs, params, stops, tok.pad_token_id, 8, vocab_limit=len(tok)
    )
    assert size == 8
    flaky = OomAbove(model, limit=2)
    shrinks = []
    got, size = generate_with_fallback(
        flaky,
        ids,
        pairs,
        params,
        stops,
        tok.pad_token_id,
        8,
        lambda old, new: shrinks.append((old, new)),
        vocab_limit=len(tok),
        decoder=decoder_for(decoding),
    )
    assert shrinks == [(8, 4), (4, 2)] and size == 2
    assert max(flaky.calls[-3:]) <= 2
    assert [r.tokens for r in got] == [r.tokens for r in reference]  # sampling does not care about the split
    with pytest.raises(PhalanxError, match="out of memory generating a single sequence"):
        generate_with_fallback(
            OomAbove(model, limit=0), ids, pairs, params, stops, tok.pad_token_id, 2, vocab_limit=len(tok)
        )


def test_other_errors_are_not_swallowed(tiny, prompts):
    model, tok = tiny

    class Broken(OomAbove):
        def forward(self, input_ids, **kwargs):
            raise RuntimeError("shape mismatch")

    with pytest.raises(RuntimeError, match="shape mismatch"):
        generate_with_fallback(
            Broken(model, 9),
            dict(enumerate(prompts)),
            [(0, 0)],
            SamplingParams(max_new_tokens=2),
            [],
            tok.pad_token_id,
            4,
        )


def test_the_cache_goes_by_the_name_the_installed_transformers_takes(tiny, prompts):
    """transformers 5.24 renamed `past_key_values` to `cache` (the old name warns, and goes in 5.40); older releases
    take only `past_key_values`. The engine passes whichever the model (or the model inside a wrapper) declares."""
    import warnings

    from phalanx.generate.kv_cache import cache_keyword as _cache_keyword

    model, tok = tiny
    declared = inspect.signature(type(model).forward).parameters
    expected = "cache" if "cache" in declared else "past_key_values"
    assert _cache_keyword(model) == expected
    assert _cache_keyword(OomAbove(model, limit=99)) == expected  # a wrapper whose forward takes **kwargs

    class OldForward(torch.nn.Module):
        def forward(self, input_ids=None, past_key_values=None, use_cache=None):
            raise AssertionError("not called")

    assert _cache_keyword(OldForward()) == "past_key_values"
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # no deprecated keyword reaches the model
        out = run(model, tok, prompts, [(0, 0), (1, 0)], SamplingParams(max_new_tokens=4, temperature=0, seed=1))
    assert all(r.computed_tokens >= 1 for r in out)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_the_fixed_cache_draws_what_the_growing_one_draws(tiny, prompts, attention):
    """Same rows, same streams, stops in the middle: the fixed-size cache (its 4-D mask built for the model's
    attention) gives every row the tokens and finish reason the growing cache gives it."""
    model, tok = tiny
    params = SamplingParams(max_new_tokens=30, temperature=0.9, top_p=0.9, seed=11)
    pairs = [(p, s) for p in range(len(prompts)) for s in range(2)]
    free = run(model, tok, prompts, pairs, params, stops=[])
    stop = free[0].tokens[7]  # a token some rows meet early and others late or never
    saved = model.config._attn_implementation
    model.config._attn_implementation = attention
    try:
        growing = run(model, tok, prompts, pairs, params, stops=[stop])
        fixed = run(model, tok, prompts, pairs, params, stops=[stop], decoder=StaticDecoder())
    finally:
        model.config._attn_implementation = saved
    assert [(r.tokens, r.finish_reason) for r in fixed] == [(r.tokens, r.finish_reason) for r in growing]
    assert {r.finish_reason for r in growing} == {"stop", "length"}


def test_the_fixed_cache_ends_at_the_first_look_that_finds_every_row_stopped(tiny, prompts):
    """Rows that stop stay in the fixed batch; the loop looks at the stop flags every CHECK_EVERY steps, so a batch
    whose rows all stop by step 4 runs CHECK_EVERY - 1 decoding forwards, not max_new_tokens."""
    from phalanx.generate.static_decode import CHECK_EVERY

    model, tok = tiny
    params = SamplingParams(max_new_tokens=40, temperature=0)
    pairs = [(0, 0), (2, 0)]
    free = run(model, tok, prompts, pairs, params, stops=[])
    stops = [free[0].tokens[3], free[1].tokens[2]]
    decoding_forwards = []
    hook = model.register_forward_pre_hook(
        lambda _m, _a, kw: decoding_forwards.append(1) if kw["input_ids"].shape[1] == 1 else None, with_kwargs=True
    )
    try:
        got = run(model, tok, prompts, pairs, params, stops=stops, decoder=StaticDecoder())
    finally:
        hook.remove()
    assert [r.finish_reason for r in got] == ["stop", "stop"]
    assert got == run(model, tok, prompts, pairs, params, stops=stops)
    assert len(decoding_forwards) == CHECK_EVERY - 1


def test_kv_cache_choice_names_what_a_model_cannot_do(tiny):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from phalanx.errors import ConfigError
    from phalanx.generate.kv_cache import fixed_cache_problem
    from phalanx.generate.static_decode import choose_decoder

    model, _ = tiny
    assert choose_decoder("auto", model) is None  # CPU: the growing cache, whose finished rows leave the batch
    assert choose_decoder("growing", model) is None
    assert isinstance(choose_decoder("fixed", model), StaticDecoder)
    with pytest.raises(ConfigError, match="--kv_cache 'static': expected one of auto, fixed, growing"):
        choose_decoder("static", model)
    windowed = Qwen2ForCausalLM(
        Qwen2Config(
            **SMALL_DECODER, num_key_value_heads=2, use_sliding_window=True, sliding_window=16, max_window_layers=0
        )
    )
    # A sliding window is served while every position fits in it (then nothing falls out of it): the job's longest
    # prompt + max_new_tokens decides, and without it the growing cache is taken.
    assert "sliding-window layers (window 16) need the job's longest prompt" in fixed_cache_problem(windowed)
    assert fixed_cache_problem(windowed, capacity=16) is None
    assert "keep 16 positions, and the longest prompt + max_new_tokens is 17" in fixed_cache_problem(windowed, 17)
    with pytest.raises(ConfigError, match="--kv_cache fixed: this model cannot .*sliding-window.*; use growing"):
        choose_decoder("fixed", windowed, capacity=17)
    assert isinstance(choose_decoder("fixed", windowed, capacity=16), StaticDecoder)
    assert choose_decoder("auto", windowed) is None
    windowed.config._attn_implementation = "flash_attention_2"
    assert "'flash_attention_2'" in fixed_cache_problem(windowed)


def test_a_graph_capture_that_fails_leaves_the_eager_step(tiny, prompts):
    """No CUDA here, so capture fails; the decoder says so once and decodes eagerly, drawing the same tokens."""
    model, tok = tiny
    said = []
    decoder = StaticDecoder(warn=said.append)
    params = SamplingParams(max_new_tokens=10, temperature=0.8, seed=2)
    pairs = [(1, 0), (3, 0)]
    reference = run(model, tok, prompts, pairs, params, decoder=decoder)
    decoder._batch.capture(said.append)
    assert len(said) == 1 and said[0].startswith("⚠️  CUDA graph capture of the decoding step failed (")
    assert decoder._batch.graph is None
    assert run(model, tok, prompts, pairs, params, decoder=decoder) == reference


def test_keys_and_values_of_different_widths_decode_as_hf_generate(decoding):
    """Multi-head latent attention (DeepSeek-V2/V3, and the R1 models built on them) caches keys 16 wide and values
    32 wide here (192 and 128 in DeepSeek-V3): both caches keep the two widths apart. The growing cache once sized
    the values' buffer from the keys' and failed at the second decoding step."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(
        **SMALL_DECODER,
        moe_intermediate_size=32,
        first_k_dense_replace=1,  # one dense layer, one mixture-of-experts layer
        num_key_value_heads=4,
        q_lora_rank=None,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=32,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
    )
    model = seeded_model(DeepseekV3ForCausalLM, config)
    prompts = [list(range(5, 30)), list(range(7, 12))]
    pairs, row_prompt = [(0, 0), (0, 1), (1, 0)], [0, 0, 1]
    params = SamplingParams(max_new_tokens=10, temperature=0)
    got = generate_rows(model, prompts, pairs, row_prompt, params, [], 0, None, decoder_for(decoding))
    assert_rows_as_hf_generate(model, prompts, row_prompt, got)


def test_graph_replays_are_checked_against_the_eager_step_over_two_steps(tiny, prompts):
    """After a capture, two replays from a reset state must give the logits of two eager steps. A graph that froze a
    value at capture (here the positions) agrees at the first step and is caught at the second. Stand-ins replace
    the CUDA graph: no CUDA here."""
    model, tok = tiny
    decoder = StaticDecoder()
    run(model, tok, prompts, [(1, 0), (3, 0)], SamplingParams(max_new_tokens=3, temperature=0), decoder=decoder)
    batch = decoder._batch

    class Faithful:
        def replay(self):
            batch.logits = batch.step()

    class FrozenPositions:
        def replay(self):
            batch.position_ids.zero_()
            batch.logits = batch.step()

    with torch.inference_mode():
        batch.graph = Faithful()
        assert batch.replay_problem() is None
        batch.graph = FrozenPositions()
        problem = batch.replay_problem()
    assert problem.startswith("gave other logits than the eager step at step 2 (largest gap ")


def test_a_kept_graph_serves_smaller_batches_with_padded_rows(tiny, prompts):
    """A job's decoder keeps one cache and graph: later batches with fewer rows or shorter prompts replay it, the
    missing rows padded and thrown away, and draw what the growing cache draws. A batch with more rows than the job's
    gets a new cache. A stand-in replays the step eagerly (no CUDA here); a decoder with no job shape makes each
    batch a cache of its own size."""
    model, tok = tiny
    said = []
    params = SamplingParams(max_new_tokens=12, temperature=0.9, top_p=0.9, seed=4)
    decoder = StaticDecoder(warn=said.append, rows=6, capacity=max(map(len, prompts)) + params.max_new_tokens)
    stops = stop_token_ids(tok, model.generation_config)
    big = [(p, s) for p in (1, 3) for s in range(3)]
    assert run(model, tok, prompts, big, params, decoder=decoder) == run(model, tok, prompts, big, params)
    kept = decoder._batch
    assert (kept.rows, kept.capacity) == (6, 256)
    kept.graph = type("EagerReplay", (), {"replay": lambda self: setattr(kept, "logits", kept.step())})()
    for small in ([(0, 0), (2, 1)], [(2, 0)], [(1, 5), (0, 2), (0, 3)]):
        got = run(model, tok, prompts, small, params, stops, decoder=decoder)
        assert decoder._batch is kept
        assert got == run(model, tok, prompts, small, params, stops)
    more_rows = [(p, s) for p in range(4) for s in range(2)]
    assert run(model, tok, prompts, more_rows, params, decoder=decoder) == run(model, tok, prompts, more_rows, params)
    assert decoder._batch is not kept and decoder._batch.rows == 8 and decoder._batch.graph is None
    assert said == []  # on CPU nothing is captured, so nothing failed
    unshaped = StaticDecoder()
    run(model, tok, prompts, [(2, 0)], params, decoder=unshaped)
    assert unshaped._batch.rows == 1  # no job shape: a cache of the batch's own size


def test_a_jobs_decoder_uses_one_cache_shape_for_every_batch(tiny, prompts):
    """Given the job's batch size and longest prompt plus max_new_tokens, every batch decodes over a cache of that
    shape whatever came before (in bf16 a kernel's rounding can follow its sizes, and a resumed job must draw what an
    uninterrupted one draws); after an out-of-memory error the rows follow the smaller batch."""
    model, tok = tiny
    params = SamplingParams(max_new_tokens=12, temperature=0.9, top_p=0.9, seed=4)
    longest = max(len(p) for p in prompts)
    decoder = StaticDecoder(rows=5, capacity=longest + params.max_new_tokens)
    for pairs in ([(0, 0), (2, 1)], [(3, 0), (3, 1), (1, 0), (0, 4), (2, 2)], [(1, 1)]):
        assert run(model, tok, prompts, pairs, params, decoder=decoder) == run(model, tok, prompts, pairs, params)
        assert (decoder._batch.rows, decoder._batch.capacity) == (5, 256)
    decoder.release(2)
    assert run(model, tok, prompts, [(1, 1)], params, decoder=decoder) == run(model, tok, prompts, [(1, 1)], params)
    assert (decoder._batch.rows, decoder._batch.capacity) == (2, 256)


def test_a_sliding_window_model_decodes_over_a_fixed_cache_inside_its_window(decoding):
    """Mistral 7B v0.1 keeps a 4,096-token window (here 48): while the prompt and the answer fit in it, no position
    falls out, and a fixed cache (its length capped at the window) draws what the growing one and HF generate draw."""
    from transformers import MistralConfig, MistralForCausalLM

    model = seeded_model(MistralForCausalLM, MistralConfig(**SMALL_DECODER, num_key_value_heads=2, sliding_window=48))
    prompts = [list(range(5, 35)), list(range(7, 12))]
    pairs, row_prompt = [(0, 0), (0, 1), (1, 0)], [0, 0, 1]
    params = SamplingParams(max_new_tokens=18, temperature=0)  # 30 + 18 = 48 positions: the whole window
    decoder = StaticDecoder(rows=3, capacity=48) if decoding == "fixed" else None
    got = generate_rows(model, prompts, pairs, row_prompt, params, [], 0, None, decoder)
    if decoder is not None:
        assert decoder._batch.capacity == 48  # rounded up to 256 elsewhere; capped at the window here
    assert_rows_as_hf_generate(model, prompts, row_prompt, got)
    if decoder is not None:
        with pytest.raises(ValueError, match="49 positions does not fit the model's sliding window 48"):
            generate_rows(
                model,
                prompts,
                pairs,
                row_prompt,
                SamplingParams(max_new_tokens=19, temperature=0),
                [],
                0,
                None,
                StaticDecoder(),
            )
