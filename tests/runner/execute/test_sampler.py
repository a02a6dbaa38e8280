"""The sampler (runner/execute/sampler.py): top-k keeps exactly k tokens, top-p keeps the
smallest nucleus that reaches p, temperature reshapes the distribution, greedy rows stay
greedy, and a seeded row draws only from its own generator, so its tokens are the same
alone or in any batch and no other row's randomness moves it."""

from __future__ import annotations

import pytest
import torch

from attnplug.runner.execute.sampler import Sampler, apply_top_k_top_p
from attnplug.runner.step.scheduler_output import SamplingParams

VOCAB = 12


def _logits(rows: int, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    """Distinct logits (so the top-k set is unique), flat enough that sampling differs from argmax."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, VOCAB, generator=g) * scale


def _mask(logits, top_k, top_p):
    out = apply_top_k_top_p(logits, torch.tensor(top_k, dtype=torch.int64), torch.tensor(top_p))
    return torch.isfinite(out)


# --- apply_top_k_top_p ----------------------------------------------------------------------
def test_top_k_keeps_exactly_the_k_largest_and_their_values():
    logits = _logits(VOCAB + 3, seed=1)
    ks = list(range(1, VOCAB + 1)) + [0, -1, VOCAB + 5]  # <= 0 and > vocab: every token
    out = apply_top_k_top_p(logits, torch.tensor(ks), torch.ones(len(ks)))
    for row, k in enumerate(ks):
        kept = torch.isfinite(out[row])
        want = VOCAB if k <= 0 or k > VOCAB else k
        assert int(kept.sum()) == want, (row, k)
        assert set(kept.nonzero().flatten().tolist()) == set(logits[row].topk(want).indices.tolist())
        assert torch.equal(out[row][kept], logits[row][kept])  # kept logits are untouched
        assert (out[row][~kept] == float("-inf")).all()


def test_top_p_keeps_the_smallest_set_whose_mass_reaches_p():
    # probabilities 0.5, 0.25, 0.125, 0.125, placed out of order (the result is in vocab order)
    probs = torch.tensor([0.125, 0.5, 0.125, 0.25])
    logits = probs.log().expand(6, 4).clone()
    top_p = [0.5, 0.51, 0.75, 0.8, 0.01, 1.0]
    kept = _mask(logits, [0] * 6, top_p)
    assert kept[0].tolist() == [False, True, False, False]  # 0.5 reaches 0.5: one token
    assert kept[1].tolist() == [False, True, False, True]
    assert kept[2].tolist() == [False, True, False, True]  # 0.75 reached by two
    assert int(kept[3].sum()) == 3 and kept[3, 1] and kept[3, 3]
    assert kept[4].tolist() == [False, True, False, False]  # at least one token
    assert kept[5].all()


def test_top_p_boundary_is_inclusive_on_an_exact_split():
    # two equal tokens: 0.5 each, exactly; p = 0.5 is reached by one of them
    kept = _mask(torch.zeros(2, 2), [0, 0], [0.5, 0.5000001])
    assert kept.sum(dim=1).tolist() == [1, 2]


def test_top_p_applies_to_the_top_k_renormalised_distribution():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().expand(2, 4).clone()
    # top-k 2 renormalises to 0.625 / 0.375: p = 0.6 keeps one token; without top-k it keeps two
    kept = _mask(logits, [2, 0], [0.6, 0.6])
    assert kept[0].tolist() == [True, False, False, False]
    assert kept[1].tolist() == [True, True, False, False]


def test_rows_are_masked_independently():
    logits = _logits(3, seed=2)
    kept = _mask(logits, [1, 3, 0], [1.0, 1.0, 1.0])
    assert kept.sum(dim=1).tolist() == [1, 3, VOCAB]


# --- Sampler ------------------------------------------------------------------------------
def _sp(t=1.0, k=0, p=1.0, seed=None):
    return SamplingParams(temperature=t, top_k=k, top_p=p, seed=seed)


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def test_all_greedy_is_argmax_and_draws_nothing():
    s = Sampler(default_seed=3)
    before = s._default_generator.get_state()
    logits = _logits(5, seed=4)
    gens = [_gen(1), None, None, _gen(2), None]
    states = [g.get_state() if g is not None else None for g in gens]
    out = s(logits, [_sp(t=0.0, k=3, p=0.5, seed=1)] * 5, gens)
    assert out.dtype == torch.int64 and torch.equal(out, logits.argmax(dim=-1))
    assert torch.equal(s._default_generator.get_state(), before)
    assert all(torch.equal(g.get_state(), st) for g, st in zip(gens, states) if g is not None)
    empty = s(torch.empty(0, VOCAB), [], [])
    assert empty.shape == (0,) and empty.dtype == torch.int64


def test_greedy_picks_argmax_s_index_on_ties_infinities_and_nans():
    """Greedy is ``argmax``'s index exactly: the first of tied maxima, ``+inf`` over finite,
    the first NaN over everything (the sampler computes it another way, for speed)."""
    s = Sampler()
    nan, inf = float("nan"), float("inf")
    rows = [[1.0, 3.0, 3.0, 0.0], [-inf, -inf, -inf, -inf], [2.0, nan, 5.0, nan], [inf, 1.0, inf, 2.0],
            [0.0, 0.0, 0.0, 0.0], [-1.0, -2.0, -0.5, -0.5]]
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        logits = torch.tensor(rows, dtype=dtype)
        out = s(logits, [_sp(t=0.0)] * len(rows), [None] * len(rows))
        assert out.tolist() == logits.argmax(dim=-1).tolist() == [1, 0, 1, 0, 0, 2], dtype
    g = torch.Generator().manual_seed(5)
    big = torch.randint(-4, 4, (64, 2048), generator=g).float()  # many ties per row
    assert torch.equal(s(big, [_sp(t=0.0)] * 64, [None] * 64), big.argmax(dim=-1))


def test_greedy_rows_stay_greedy_in_a_sampled_batch():
    logits = _logits(64, seed=5, scale=0.3)
    params = [_sp(t=0.0) if i % 2 else _sp(t=1.0) for i in range(64)]
    out = Sampler()(logits, params, [None] * 64)
    argmax = logits.argmax(dim=-1)
    assert torch.equal(out[1::2], argmax[1::2])
    assert not torch.equal(out[0::2], argmax[0::2])  # the sampled rows really sample


def _frequencies(logits_row, params, n=6000, seed=0):
    out = Sampler(default_seed=seed)(logits_row.expand(n, -1).clone(), [params] * n, [None] * n)
    return torch.bincount(out, minlength=logits_row.shape[0]).double() / n


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_draws_from_softmax_of_logits_over_t(temperature):
    row = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0, -2.0])
    freq = _frequencies(row, _sp(t=temperature))
    want = torch.softmax(row.double() / temperature, dim=0)
    assert (freq - want).abs().max() < 0.03, (freq, want)


def test_top_k_and_top_p_limit_what_is_drawn():
    row = torch.tensor([0.1, 0.0, -0.1, 0.2, -0.2, 0.05])
    freq = _frequencies(row, _sp(k=3))
    assert set(freq.nonzero().flatten().tolist()) == {0, 3, 5}  # all three, and only them
    kept = torch.softmax(row[[0, 3, 5]].double(), dim=0)
    assert (freq[[0, 3, 5]] - kept).abs().max() < 0.03
    freq = _frequencies(row, _sp(k=1))
    assert freq[3] == 1.0
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    freq = _frequencies(probs, _sp(p=0.7))
    assert freq[2] == freq[3] == 0 and abs(freq[0] - 0.625) < 0.03


def _run_alone(logits_steps, params, seed):
    g = _gen(seed)
    s = Sampler(default_seed=11)
    return [int(s(lg.unsqueeze(0), [params], [g])[0]) for lg in logits_steps]


def test_a_seeded_row_draws_the_same_alone_and_in_any_batch():
    steps = 12
    mine = [_logits(1, seed=100 + t, scale=0.3)[0] for t in range(steps)]
    params = _sp(t=1.0, k=8, p=0.95, seed=7)
    alone = _run_alone(mine, params, seed=7)
    assert len(set(alone)) > 2  # it really samples
    for where, batch_size, default_seed in [(0, 4, 0), (3, 4, 1), (2, 7, 2)]:
        s = Sampler(default_seed=default_seed)
        g_mine = _gen(7)
        others = [_gen(50 + i) if i % 2 else None for i in range(batch_size)]
        got = []
        for t in range(steps):
            logits = _logits(batch_size, seed=200 + t, scale=0.3)
            logits[where] = mine[t]
            params_list = [_sp(t=0.8, k=5, seed=1) for _ in range(batch_size)]
            params_list[where] = params
            gens = list(others)
            gens[where] = g_mine
            got.append(int(s(logits, params_list, gens)[where]))
        assert got == alone, (where, batch_size)


def test_seeded_rows_never_touch_the_shared_generator():
    logits = _logits(4, seed=8, scale=0.3)
    s = Sampler(default_seed=5)
    before = s._default_generator.get_state()
    gens = [_gen(i) for i in range(4)]
    out = s(logits, [_sp(seed=i) for i in range(4)], gens)
    assert torch.equal(s._default_generator.get_state(), before)
    # each seeded generator advanced by exactly one row's draw
    for g, i in zip(gens, range(4)):
        ref = _gen(i)
        torch.empty(VOCAB).exponential_(generator=ref)
        assert torch.equal(g.get_state(), ref.get_state())
    # the seeded rows' tokens do not depend on the sampler's own seed
    assert torch.equal(Sampler(default_seed=99)(logits, [_sp(seed=i) for i in range(4)],
                                                [_gen(i) for i in range(4)]), out)


def test_unseeded_rows_do_not_depend_on_seeded_neighbours():
    logits = _logits(5, seed=9, scale=0.3)
    unseeded = [0, 2, 4]
    a = Sampler(default_seed=6)(logits[unseeded], [_sp()] * 3, [None] * 3)
    mixed = Sampler(default_seed=6)(logits, [_sp(), _sp(seed=1), _sp(), _sp(seed=2), _sp()],
                                    [None, _gen(1), None, _gen(2), None])
    assert torch.equal(mixed[unseeded], a)


def test_shared_generator_advances_across_steps():
    logits = _logits(16, seed=10, scale=0.1)
    s = Sampler(default_seed=0)
    first = s(logits, [_sp()] * 16, [None] * 16)
    second = s(logits, [_sp()] * 16, [None] * 16)
    assert not torch.equal(first, second)


def test_the_default_seed_is_zero():
    logits = _logits(16, seed=12, scale=0.1)
    params = [_sp()] * 16
    assert torch.equal(Sampler()(logits, params, [None] * 16), Sampler(default_seed=0)(logits, params, [None] * 16))


def test_top_p_of_one_keeps_every_token_of_a_large_vocabulary():
    """The cumulative sum rounds (float32): with 32,000 tokens the mass before the tail
    reaches 1.0 early, so top_p = 1.0 must not be compared at all (found while building
    the rejection sampler: rows lost up to 2,508 tokens)."""
    torch.manual_seed(0)
    logits = torch.randn(8, 32_000) * 3
    out = apply_top_k_top_p(logits, torch.zeros(8, dtype=torch.int64), torch.ones(8))
    assert torch.isfinite(out).all()
    assert torch.equal(out, logits)
