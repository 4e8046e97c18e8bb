"""Sampler: greedy, temperature, top-k, top-p sets, per-request seeds; SamplingParams checks."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zipfusion.engine.sampling import Sampler, SamplingParams, _top_k_top_p


def test_greedy_rows_take_the_argmax():
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))
    s = Sampler("cpu")
    ps = [SamplingParams(temperature=0)] * 5
    assert torch.equal(s(logits, ps, [None] * 5), logits.argmax(-1))


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31), k=st.integers(1, 40), p=st.floats(0.05, 1.0))
def test_top_k_top_p_keeps_exactly_the_nucleus(seed, k, p):
    x = torch.randn(1, 40, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).float()
    kept = torch.isfinite(_top_k_top_p(x, torch.tensor([k]), torch.tensor([p])))[0]
    order = x[0].argsort(descending=True)
    topk = order[:k]
    probs = torch.softmax(x[0][topk], -1)
    # nucleus: smallest prefix of the top-k whose mass reaches p (the first token always stays)
    n = int((torch.cumsum(probs, 0) - probs < p).sum())
    expect = torch.zeros(40, dtype=torch.bool)
    expect[topk[:max(n, 1)]] = True
    assert torch.equal(kept, expect)


def test_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).expand(4000, 4)
    s = Sampler("cpu", seed=1)

    def freq(**kw):
        draws = s(logits, [SamplingParams(**kw)] * 4000, [None] * 4000)
        return torch.bincount(draws, minlength=4).float() / 4000

    assert torch.allclose(freq(temperature=1.0), torch.tensor([0.5, 0.3, 0.15, 0.05]), atol=0.03)
    f = freq(temperature=1.0, top_p=0.6)              # keeps {0, 1}, renormalised: 0.625 / 0.375
    assert f[2:].sum() == 0 and abs(float(f[0]) - 0.625) < 0.03
    f = freq(temperature=1.0, top_k=3)
    assert f[3] == 0 and abs(float(f[2]) - 0.15 / 0.95) < 0.03
    assert freq(temperature=0.1)[0] > 0.95            # low temperature sharpens towards the argmax


def test_seeded_rows_do_not_depend_on_the_batch():
    V = 100
    s = Sampler("cpu")
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(3))
    sp = SamplingParams(temperature=1.0, seed=5)
    alone = [int(s(logits[:1], [sp], [s.make_generator(5)])) for _ in range(1)]
    g = s.make_generator(5)
    batch = s(logits, [sp, SamplingParams(temperature=1.0), SamplingParams(temperature=0)], [g, None, None])
    assert int(batch[0]) == alone[0]
    assert int(batch[2]) == int(logits[2].argmax())


@pytest.mark.parametrize("kw, match", [
    (dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"), (dict(max_tokens=0), "max_tokens"), (dict(stop=[""]), "stop"),
    (dict(stop_token_ids=["a"]), "stop_token_ids"), (dict(min_tokens=-1), "min_tokens"),
])
def test_bad_sampling_params(kw, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kw)
    with pytest.raises(TypeError, match="seed"):
        SamplingParams(seed="1")


def test_stop_string_is_listified():
    assert SamplingParams(stop="\n").stop == ["\n"]


def _reference_penalties(row, prompt, output, rep, freq, pres, bias):
    """vLLM's semantics, one token at a time."""
    x = row.clone()
    for t, b in bias.items():
        x[t] += b
    for t in set(prompt) | set(output):
        x[t] = x[t] / rep if x[t] > 0 else x[t] * rep
    for t in set(output):
        x[t] -= freq * output.count(t) + pres
    return x


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31), rep=st.floats(0.5, 2.0), freq=st.floats(-2, 2), pres=st.floats(-2, 2),
       prompt=st.lists(st.integers(0, 29), max_size=8), output=st.lists(st.integers(0, 29), max_size=12))
def test_penalties_match_the_reference(seed, rep, freq, pres, prompt, output):
    from zipfusion.engine.sampling import apply_penalties
    logits = torch.randn(3, 30, generator=torch.Generator().manual_seed(seed))
    bias = {3: 5.0, 7: -100.0}
    ps = [SamplingParams(temperature=0), SamplingParams(repetition_penalty=rep, frequency_penalty=freq,
                                                        presence_penalty=pres, logit_bias=bias),
          SamplingParams(logit_bias={"4": 1.5})]
    got = apply_penalties(logits, ps, [None, (prompt, output), None])
    assert torch.equal(got[0], logits[0])                      # rows without any are untouched
    assert torch.allclose(got[1], _reference_penalties(logits[1], prompt, output, rep, freq, pres, bias), atol=1e-5)
    expect = logits[2].clone()
    expect[4] += 1.5
    assert torch.allclose(got[2], expect)


def test_penalties_change_greedy_choice_and_bias_forces_a_token():
    logits = torch.tensor([[3.0, 2.9, 0.0, -1.0]])
    s = Sampler("cpu")
    assert int(s(logits, [SamplingParams(temperature=0)], [None])) == 0
    sp = SamplingParams(temperature=0, repetition_penalty=1.2)
    assert int(s(logits, [sp], [None], [([0], [])])) == 1      # token 0 was in the prompt: 3/1.2 < 2.9
    sp = SamplingParams(temperature=0, frequency_penalty=0.05)
    assert int(s(logits, [sp], [None], [([], [0, 0, 0])])) == 1
    sp = SamplingParams(temperature=0, presence_penalty=0.2)
    assert int(s(logits, [sp], [None], [([0], [])])) == 0     # presence counts only generated tokens
    assert int(s(logits, [sp], [None], [([], [0])])) == 1
    draws = s(logits.expand(50, 4), [SamplingParams(logit_bias={3: 100})] * 50, [None] * 50)
    assert (draws == 3).all()
    with pytest.raises(ValueError, match="history|prompt"):
        s(logits, [SamplingParams(repetition_penalty=1.5)], [None])


def test_compute_logprobs_are_the_raw_distribution():
    from zipfusion.engine.sampling import compute_logprobs
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 0.0, 5.0, 1.0]])
    lp = torch.log_softmax(logits, -1)
    out = compute_logprobs(logits, torch.tensor([3, 2]), [2, 0])
    assert set(out[0]) == {3, 0, 1}                                   # sampled + top 2
    assert out[0][3].rank == 4 and abs(out[0][3].logprob - float(lp[0, 3])) < 1e-6
    assert out[0][0].rank == 1 and abs(out[0][0].logprob - float(lp[0, 0])) < 1e-6
    assert list(out[1]) == [2] and out[1][2].rank == 1


@pytest.mark.parametrize("kw, match", [
    (dict(presence_penalty=3), "presence_penalty"), (dict(frequency_penalty=-2.5), "frequency_penalty"),
    (dict(repetition_penalty=0), "repetition_penalty"), (dict(logprobs=-1), "logprobs"),
    (dict(logprobs=True), "logprobs"), (dict(logit_bias={"x": 1}), "logit_bias"),
    (dict(logit_bias={1: 200}), "logit_bias"),
])
def test_bad_penalty_params(kw, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kw)


def test_engine_returns_logprobs_and_applies_penalties():
    from zipfusion.engine import LLM
    llm = LLM("demo", device="cpu", kv_memory_gb=0.02, max_model_len=128)
    base = dict(temperature=0, max_tokens=12, ignore_eos=True)
    plain, lp = llm.generate(["In the beginning"] * 2, [SamplingParams(**base), SamplingParams(**base, logprobs=3)],
                             use_tqdm=False)
    assert plain.token_ids == lp.token_ids and plain.outputs[0].logprobs is None
    entries = lp.outputs[0].logprobs
    assert len(entries) == 12
    for tok, entry in zip(lp.token_ids, entries):
        assert tok in entry and entry[tok].rank == 1 and len(entry) == 3     # greedy: the top token
        assert max(e.logprob for e in entry.values()) == entry[tok].logprob <= 0
    rep = llm.generate("In the beginning", SamplingParams(**base, repetition_penalty=2.0), use_tqdm=False)[0]
    assert rep.token_ids != plain.token_ids            # the demo model repeats itself; a strong penalty changes that
    with pytest.raises(ValueError, match="max_logprobs"):
        llm.generate("x", SamplingParams(logprobs=21), use_tqdm=False)
