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
