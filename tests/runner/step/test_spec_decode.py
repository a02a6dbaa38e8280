"""Speculative decoding pieces (runner/execute/spec_decode/): the n-gram drafter against a
brute-force reference, the ``--speculative`` parser's errors, ``SpecDecodeMetadata`` on
worked examples, greedy verification == sequential greedy, the random accept/reject rule
reproducing the target distribution (chi-square), and per-request generators making a
request's draws independent of its batch."""

from __future__ import annotations

import random

import pytest
import torch

from attnplug.core.errors import ConfigError
from attnplug.runner.execute.sampler import Sampler
from attnplug.runner.execute.spec_decode import (
    PLACEHOLDER_TOKEN_ID, NgramDrafter, RejectionSampler, SpeculativeConfig,
    build_spec_decode_metadata, parse_speculative, target_probs)
from attnplug.runner.step.scheduler_output import SamplingParams

GREEDY = SamplingParams()


# --- n-gram drafter ---------------------------------------------------------------------------
def _reference_ngram(h, k, max_n, min_n):
    """Plain-loop prompt lookup: the spec NgramDrafter's docstring states."""
    for n in range(max_n, min_n - 1, -1):
        if len(h) < n + 1:
            continue
        for s in range(len(h) - n - 1, -1, -1):
            if h[s:s + n] == h[len(h) - n:]:
                return h[s + n:s + n + k]
    return []


@pytest.mark.parametrize("history, max_n, min_n, k, want", [
    ([1, 2, 3, 4, 1, 2, 3], 3, 1, 3, [4, 1, 2]),
    ([1, 2, 9, 1, 2, 8, 1, 2], 2, 1, 2, [8, 1]),          # the most recent earlier match
    ([7, 1, 2, 5, 3, 2, 6, 1, 2], 2, 1, 3, [5, 3, 2]),    # a longer match beats a later shorter one
    ([7, 1, 2, 5, 3, 2, 6, 1, 2], 1, 1, 3, [6, 1, 2]),
    ([1, 2, 3, 2], 2, 2, 3, []),                          # nothing of length >= min_n
    ([1, 2, 3, 2], 2, 1, 3, [3, 2]),                      # fewer than k near the end
    ([5, 5, 5, 5], 3, 1, 4, [5]),                         # a match may overlap the suffix
    ([4], 3, 1, 3, []),
    ([], 3, 1, 3, []),
    ([1, 2, 1, 2], 2, 1, 0, []),
])
def test_ngram_worked_examples(history, max_n, min_n, k, want):
    assert NgramDrafter(max_n=max_n, min_n=min_n).propose([history], k) == [want]


def test_ngram_matches_reference_on_random_histories():
    rng = random.Random(0)
    drafter = NgramDrafter(max_n=4, min_n=2)
    hists = [[rng.randrange(4) for _ in range(rng.randrange(0, 40))] for _ in range(300)]
    ks = [rng.randrange(0, 6) for _ in hists]
    got = drafter.propose(hists, ks)
    assert got == [_reference_ngram(h, k, 4, 2) for h, k in zip(hists, ks)]
    assert sum(map(len, got)) > 300  # the histories do draft (the check is not vacuous)


def test_ngram_bad_arguments():
    with pytest.raises(ValueError, match="min_n <= max_n"):
        NgramDrafter(max_n=2, min_n=3)
    with pytest.raises(ValueError, match=">= 0"):
        NgramDrafter().propose([[1, 2]], -1)
    with pytest.raises(ValueError, match="2 entries for 1 requests"):
        NgramDrafter().propose([[1, 2]], [1, 2])


def test_parse_speculative_good():
    assert parse_speculative("ngram:k=3") == SpeculativeConfig("ngram", k=3, max_n=3, min_n=1)
    cfg = parse_speculative(" ngram: k=4, n=5 ,min_n=2")
    assert (cfg.k, cfg.max_n, cfg.min_n) == (4, 5, 2)
    assert isinstance(cfg.make_drafter(), NgramDrafter) and cfg.make_drafter().max_n == 5


@pytest.mark.parametrize("text, msg", [
    ("ngram", "needs k"),
    ("ngram:n=2", "needs k"),
    ("ngram:k=0", "k must be >= 1"),
    ("ngram:k=-1", "not a non-negative integer"),
    ("ngram:k=x", "not a non-negative integer"),
    ("ngram:k=3,k=4", "given twice"),
    ("ngram:k=3,depth=2", "unknown key 'depth'"),
    ("ngram:k3", "not key=value"),
    ("ngram:k=3,n=2,min_n=3", "min_n must be in 1..n=2"),
    ("ngram:k=3,n=0", "n must be >= 1"),
    ("eagle:k=3", "unknown speculative method 'eagle'"),
    ("draft:k=3", "draft needs model="),
    ("draft:model=x.json", "draft needs k"),
    ("draft:k=3,n=2,model=x.json", "unknown key 'n' for draft"),
])
def test_parse_speculative_errors_are_one_line(text, msg):
    with pytest.raises(ConfigError, match=msg) as e:
        parse_speculative(text, origin="attnplug.toml")
    assert str(e.value).startswith("attnplug.toml: ") and "\n" not in str(e.value)


# --- SpecDecodeMetadata -----------------------------------------------------------------------
def test_metadata_worked_example():
    input_ids = torch.arange(100, 108)
    m = build_spec_decode_metadata([0, 3, 4, 8], [2, 0, 3], input_ids=input_ids)
    assert m.num_draft_tokens == [2, 0, 3] and m.max_spec_len == 3 and m.num_reqs == 3
    assert m.cu_num_draft_tokens.tolist() == [2, 2, 5]
    assert m.logits_indices.tolist() == [0, 1, 2, 3, 4, 5, 6, 7]
    assert m.target_logits_indices.tolist() == [0, 1, 4, 5, 6]
    assert m.bonus_logits_indices.tolist() == [2, 3, 7]
    assert m.draft_token_ids.tolist() == [101, 102, 105, 106, 107]
    for t in (m.cu_num_draft_tokens, m.logits_indices, m.target_logits_indices,
              m.bonus_logits_indices, m.draft_token_ids):
        assert t.dtype == torch.int64


def test_metadata_with_prefill_rows_and_explicit_drafts():
    # Row 0 is a 5-token prefill chunk (no drafts); row 1 verifies 1 draft after 1 real token.
    m = build_spec_decode_metadata([0, 5, 7], [0, 1], draft_token_ids=[[], [42]])
    assert m.logits_indices.tolist() == [4, 5, 6]
    assert m.target_logits_indices.tolist() == [1]
    assert m.bonus_logits_indices.tolist() == [0, 2]
    assert m.draft_token_ids.tolist() == [42]
    # Without drafts the layout is the ordinary one: each row's last token.
    plain = build_spec_decode_metadata([0, 5, 6, 9], [0, 0, 0], input_ids=torch.zeros(9, dtype=torch.int64))
    assert plain.logits_indices.tolist() == [4, 5, 8] and plain.bonus_logits_indices.tolist() == [0, 1, 2]
    assert plain.target_logits_indices.numel() == 0 and plain.draft_token_ids.numel() == 0
    none = build_spec_decode_metadata([0, 5, 6], [0, 0], draft_token_ids=[[], []])  # no drafts to list: still int64
    assert none.draft_token_ids.dtype == torch.int64 and none.draft_token_ids.numel() == 0


def test_metadata_of_some_rows_describes_those_rows_only():
    """``rows``: the worked example's rows 0 and 2 (explicit drafts), then rows 1 and 2 (drafts read
    from ``input_ids``); the indices still point into the whole step's token stream."""
    m = build_spec_decode_metadata([0, 3, 4, 8], [2, 0, 3], draft_token_ids=[[1, 2], [], [3, 4, 5]], rows=[0, 2])
    assert m.num_draft_tokens == [2, 3] and m.cu_num_draft_tokens.tolist() == [2, 5]
    assert m.logits_indices.tolist() == [0, 1, 2, 4, 5, 6, 7] and m.bonus_logits_indices.tolist() == [2, 6]
    assert m.target_logits_indices.tolist() == [0, 1, 3, 4, 5] and m.draft_token_ids.tolist() == [1, 2, 3, 4, 5]
    m = build_spec_decode_metadata([0, 3, 4, 8], [2, 0, 3], input_ids=torch.arange(100, 108), rows=[1, 2])
    assert m.num_draft_tokens == [0, 3] and m.logits_indices.tolist() == [3, 4, 5, 6, 7]
    assert m.target_logits_indices.tolist() == [1, 2, 3] and m.bonus_logits_indices.tolist() == [0, 4]
    assert m.draft_token_ids.tolist() == [105, 106, 107]


@pytest.mark.parametrize("qsl, counts, kwargs, msg", [
    ([0, 2], [2], {"input_ids": torch.zeros(2, dtype=torch.int64)}, "row 0: query length 2 < 1 \\+ 2"),
    ([0, 2], [-1], {"input_ids": torch.zeros(2, dtype=torch.int64)}, "negative"),
    ([0, 2, 3], [1], {"input_ids": torch.zeros(3, dtype=torch.int64)}, "need num_reqs \\+ 1 = 2"),
    ([0, 2], [1], {}, "exactly one"),
    ([0, 2], [1], {"draft_token_ids": [[1, 2]]}, "row 0: 2 draft ids"),
    ([[0, 2]], [1], {"input_ids": torch.zeros(2, dtype=torch.int64)},
     r"query_start_loc must be a 1-D integer sequence, got shape \(1, 2\) dtype int64"),
    ([0, 2], [1.0], {"input_ids": torch.zeros(2, dtype=torch.int64)},
     r"num_draft_tokens must be a 1-D integer sequence, got shape \(1,\) dtype float64"),
    ([0, 2], [1], {"input_ids": torch.zeros(1, 2, dtype=torch.int64)}, r"input_ids must be 1-D, got shape \(1, 2\)"),
])
def test_metadata_errors(qsl, counts, kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        build_spec_decode_metadata(qsl, counts, **kwargs)


# --- greedy verification ----------------------------------------------------------------------
V = 7
_TABLE = torch.randn(V, V, V, generator=torch.Generator().manual_seed(3))


def _toy_logits(context: list[int]) -> torch.Tensor:
    """A fixed "model": next-token logits from the last two tokens."""
    return _TABLE[context[-2], context[-1]]


def test_greedy_verification_equals_sequential_greedy():
    rng = random.Random(1)
    drafter, sampler = NgramDrafter(max_n=2, min_n=1), RejectionSampler()
    prompts = [[rng.randrange(V) for _ in range(rng.randrange(2, 9))] for _ in range(6)]
    want = []
    for p in prompts:  # sequential greedy, 40 tokens each
        h = list(p)
        for _ in range(40):
            h.append(int(_toy_logits(h).argmax()))
        want.append(h[len(p):])
    hists, steps, partial = [list(p) for p in prompts], 0, 0
    while any(len(h) - len(p) < 40 for h, p in zip(hists, prompts)):
        # Mix the n-gram drafts with random ones, so some are rejected part-way.
        drafts = [d if rng.random() < 0.5 else [rng.randrange(V) for _ in range(rng.randrange(4))]
                  for d in drafter.propose(hists, 3)]
        qsl, logits = [0], []
        for h, d in zip(hists, drafts):  # the row's query: its last token, then its drafts
            qsl.append(qsl[-1] + 1 + len(d))
            logits += [_toy_logits(h + d[:j]) for j in range(len(d) + 1)]
        m = build_spec_decode_metadata(qsl, [len(d) for d in drafts], draft_token_ids=drafts)
        out = sampler(m, torch.stack(logits), [GREEDY] * len(hists), [None] * len(hists))
        for h, d, toks, n_acc in zip(hists, drafts, out.to_lists(), out.num_accepted.tolist()):
            assert toks[:n_acc] == d[:n_acc] and len(toks) == n_acc + 1
            partial += 0 < n_acc < len(d)
            h.extend(toks)
        steps += 1
    assert [h[len(p):len(p) + 40] for h, p in zip(hists, prompts)] == want
    assert steps < 40 and partial > 0  # drafts were accepted, and some only in part


def test_greedy_output_layout():
    logits = torch.full((5, V), -1.0)
    for row, tok in enumerate([2, 3, 4, 5, 6]):
        logits[row, tok] = 1.0
    # Request 0: drafts [2, 0] -> accepts 2, rejects 0, emits 3. Request 1: drafts [5] on logits
    # rows 3..4 -> accepts, bonus 6.
    m = build_spec_decode_metadata([0, 3, 5], [2, 1], draft_token_ids=[[2, 0], [5]])
    out = RejectionSampler()(m, logits, [GREEDY] * 2, [None] * 2)
    assert out.token_ids.tolist() == [[2, 3, PLACEHOLDER_TOKEN_ID], [5, 6, PLACEHOLDER_TOKEN_ID]]
    assert out.num_accepted.tolist() == [1, 1] and out.to_lists() == [[2, 3], [5, 6]]
    with pytest.raises(ValueError, match="outside the vocabulary"):
        bad = build_spec_decode_metadata([0, 3, 5], [2, 1], draft_token_ids=[[2, V], [5]])
        RejectionSampler()(bad, logits, [GREEDY] * 2, [None] * 2)
    with pytest.raises(ValueError, match=r"logits must be \[5, V\]"):
        RejectionSampler()(m, logits[:4], [GREEDY] * 2, [None] * 2)


# --- random verification: the emitted tokens follow the target ------------------------------
CHI2_CRIT_DF3 = 16.27
"""Chi-square critical value, 3 degrees of freedom, alpha = 0.001 (standard tables)."""
P0 = torch.tensor([0.5, 0.3, 0.15, 0.05])   # target at the draft's position
P1 = torch.tensor([0.1, 0.2, 0.3, 0.4])     # target at the bonus position
Q0 = torch.tensor([0.1, 0.2, 0.3, 0.4])     # the draft distribution (far from P0)
N = 20_000
HOT = SamplingParams(temperature=1.0)


def _chi2(tokens: torch.Tensor, p: torch.Tensor) -> float:
    """Pearson's statistic of the observed token counts against ``len(tokens) * p``."""
    observed = torch.bincount(tokens, minlength=p.numel()).double()
    expected = p.double() * tokens.numel()
    return float(((observed - expected) ** 2 / expected).sum())


def _one_draft_batch(drafts: torch.Tensor):
    """``len(drafts)`` requests, each verifying one draft against P0 then bonus P1."""
    n = drafts.numel()
    m = build_spec_decode_metadata(torch.arange(0, 2 * n + 1, 2), [1] * n,
                                   input_ids=torch.stack([torch.zeros_like(drafts), drafts], 1).flatten())
    logits = torch.stack([P0.log(), P1.log()]).repeat(n, 1)  # temperature 1: softmax = P
    return m, logits


def test_random_first_token_follows_target_with_draft_distribution():
    g = torch.Generator().manual_seed(11)
    drafts = torch.multinomial(Q0, N, replacement=True, generator=g)
    m, logits = _one_draft_batch(drafts)
    out = RejectionSampler(default_seed=5)(m, logits, [HOT] * N, [None] * N,
                                           draft_probs=Q0.repeat(N, 1))
    first = out.token_ids[:, 0]
    stat = _chi2(first, P0)
    # A wrong rule is far off: accepting with p(x) gives [.71, .225, .045, .02] (stat ~ 1e4);
    # resampling from p gives [.35, .35, .225, .075] (stat ~ 2e3).
    assert stat < CHI2_CRIT_DF3, stat
    accepted = out.num_accepted == 1
    assert abs(accepted.double().mean().item() - float(torch.minimum(P0, Q0).sum())) < 0.02
    assert _chi2(out.token_ids[accepted, 1], P1) < CHI2_CRIT_DF3  # the bonus token follows P1


def test_random_first_token_follows_target_with_one_hot_drafts():
    # n-gram drafts: q = one_hot(x); every request drafts token 0, then token 3.
    for tok in (0, 3):
        m, logits = _one_draft_batch(torch.full((N,), tok, dtype=torch.int64))
        out = RejectionSampler(default_seed=tok)(m, logits, [HOT] * N, [None] * N)
        assert _chi2(out.token_ids[:, 0], P0) < CHI2_CRIT_DF3, tok
        assert abs(out.num_accepted.double().mean().item() - float(P0[tok])) < 0.02


# --- per-request generators -------------------------------------------------------------------
def _gen(seed):
    return torch.Generator().manual_seed(seed)


def test_a_seeded_request_draws_the_same_alone_and_in_any_batch():
    lg = torch.randn(40, V, generator=_gen(7))
    drafts_a = [1, 4, 2]

    def run(batch):  # batch: list of (drafts, params, generator); returns each row's output
        counts = [len(d) for d, _, _ in batch]
        qsl = [0]
        for c in counts:
            qsl.append(qsl[-1] + c + 1)
        m = build_spec_decode_metadata(qsl, counts, draft_token_ids=[d for d, _, _ in batch])
        rows, start = [], 0  # request a always sees the same logits rows 0..3
        for i, c in enumerate(counts):
            rows += list(range(0, 4)) if batch[i][0] is drafts_a else list(range(start + 4, start + 5 + c))
            start += c + 1
        return RejectionSampler(default_seed=len(batch))(
            m, lg[rows], [p for _, p, _ in batch], [g for _, _, g in batch]).to_lists()

    hot_a = SamplingParams(temperature=0.9, top_k=5, seed=1)
    ga = _gen(1)
    alone = [run([(drafts_a, hot_a, ga)])[0] for _ in range(5)]  # five steps
    for pos in range(3):
        ga = _gen(1)
        others = [([3, 3], SamplingParams(temperature=1.3), None), ([], HOT, _gen(9)),
                  ([5], GREEDY, None)]
        got = []
        for _ in range(5):
            batch = others[:pos] + [(drafts_a, hot_a, ga)] + others[pos:]
            got.append(run(batch)[pos])
        assert got == alone, pos
    assert len({tuple(x) for x in alone}) > 1  # the steps differ: the draws advance


def test_a_request_without_drafts_samples_as_the_plain_sampler():
    lg = torch.randn(6, V, generator=_gen(2))
    params = [SamplingParams(temperature=0.7, top_p=0.8, seed=s) for s in range(6)]
    m = build_spec_decode_metadata(list(range(7)), [0] * 6, draft_token_ids=[[]] * 6)
    spec = RejectionSampler()(m, lg, params, [_gen(s) for s in range(6)]).token_ids[:, 0]
    plain = Sampler()(lg, params, [_gen(s) for s in range(6)])
    assert spec.tolist() == plain.tolist()


def _reference_request(drafts, logits, q, param, g):
    """One request verified with plain loops, drawing as the module doc says: d uniforms,
    then [d + 1, V] Exp(1) noise."""
    d, vocab = len(drafts), logits.shape[1]
    if param.temperature <= 0:
        out = []
        for j, x in enumerate(drafts):
            out.append(int(logits[j].argmax()))
            if out[-1] != x:
                return out
        return out + [int(logits[d].argmax())]
    u, e = torch.rand(d, generator=g), torch.empty((d + 1, vocab)).exponential_(generator=g)
    out = []
    for j, x in enumerate(drafts):
        p = target_probs(logits[j:j + 1], [param])[0]
        qj = q[j] if q is not None else torch.nn.functional.one_hot(torch.tensor(x), vocab).float()
        if u[j] * qj[x] < p[x]:
            out.append(x)
            continue
        r = (p - qj).clamp(min=0)
        return out + [int(((r if r.sum() > 0 else p) / e[j]).argmax())]
    p = target_probs(logits[d:d + 1], [param])[0]
    return out + [int((p / e[d]).argmax())]


@pytest.mark.parametrize("with_q", [False, True])
def test_batch_matches_the_per_request_reference(with_q):
    rng, tg = random.Random(4), _gen(4)
    R = 12
    counts = [rng.randrange(4) for _ in range(R)]
    params = [GREEDY if i % 4 == 0 else SamplingParams(temperature=rng.choice([0.5, 1.0, 2.0]),
                                                        top_k=rng.choice([0, 3]), seed=i)
              for i in range(R)]
    logits = torch.randn(sum(counts) + R, V, generator=tg) * 2
    q = torch.softmax(torch.randn(sum(counts), V, generator=tg), -1) if with_q else None
    # Drafts: half the argmax of the target (often accepted), half arbitrary.
    drafts, row = [], 0
    for c in counts:
        drafts.append([int(logits[row + j].argmax()) if rng.random() < 0.5 else rng.randrange(V)
                       for j in range(c)])
        row += c + 1
    qsl = [0]
    for c in counts:
        qsl.append(qsl[-1] + c + 1)
    m = build_spec_decode_metadata(qsl, counts, draft_token_ids=drafts)
    got = RejectionSampler()(m, logits, params, [_gen(i) for i in range(R)], draft_probs=q).to_lists()
    want, row, drow = [], 0, 0
    for i, c in enumerate(counts):
        want.append(_reference_request(drafts[i], logits[row:row + c + 1],
                                       None if q is None else q[drow:drow + c], params[i], _gen(i)))
        row, drow = row + c + 1, drow + c
    assert got == want
    assert len({len(w) for w in want}) > 1
