"""Property mode: random attention cases within a backend's declared support (hypothesis).

:func:`case_strategy` draws :class:`~attnplug.plugins.conformance.cases.ConformanceCase`
objects from what the backend declares — its dtypes, head sizes, kernel block sizes and
``features()`` (windows, soft-cap, GQA/MQA) — with random softmax scales, batches (mixes of decodes,
prefills and chunked-prefill continuations), block sizes and orders, padding, history
chunks and seeds. :func:`case_problems` runs one on the backend and on torch_native and
returns every check's problems. ``attnplug check NAME --hypothesis N`` (``--attnplug-hypothesis
N``) draws N cases; hypothesis shrinks a failing one and the test prints its JSON, ready
for ``--cases``.
"""

from __future__ import annotations

from hypothesis import strategies as st

from attnplug.core.contracts import AttentionBackend
from attnplug.plugins.conformance import checks
from attnplug.plugins.conformance.cases import DTYPES, ConformanceCase
from attnplug.plugins.conformance.harness import run_case
from attnplug.plugins.conformance.requirements import assess, torch_dtype

HEAD_SIZES = (32, 64, 128)
"""Head sizes drawn for a backend that declares any (``supported_head_sizes = None``)."""
SCALES = (256 ** -0.5, 0.125, 0.5, 1.0)
"""Softmax scales drawn besides ``None`` (``head_size ** -0.5``): what models pass instead
(Gemma's ``query_pre_attn_scalar ** -0.5``, scale 1.0...)."""
BLOCK_SIZES = (1, 4, 8, 16, 32)
"""Manager block sizes drawn (those the backend's kernel block sizes divide)."""
CASE_NAME = "hypothesis_case"


def case_strategy(backend: type[AttentionBackend]) -> st.SearchStrategy[ConformanceCase]:
    """Cases whose every need the backend declares.

    Raises:
        ValueError: the declarations leave nothing to draw (no dtype, head size or block
            size of the suite's).
    """
    feats = backend.features()
    dtypes = [d for d in DTYPES if torch_dtype(d) in backend.supported_dtypes]
    heads = [h for h in HEAD_SIZES if backend.supported_head_sizes is None or h in backend.supported_head_sizes]
    blocks = [b for b in BLOCK_SIZES if backend.get_supported_kernel_block_size(b) is not None]
    if not (dtypes and heads and blocks):
        raise ValueError(f"backend {backend.get_name()!r} declares no dtype of {DTYPES}, head size of {HEAD_SIZES} "
                         f"or block size of {BLOCK_SIZES} the suite draws from")
    request = st.tuples(st.integers(0, 40), st.integers(1, 9))
    decode = st.tuples(st.integers(1, 40), st.just(1))
    group = st.sampled_from([1, 2, 4]) if feats.get("mqa_gqa") else st.just(1)

    @st.composite
    def draw(d) -> ConformanceCase:
        kv_heads = d(st.sampled_from([1, 2]))
        return ConformanceCase(
            name=CASE_NAME,
            requests=tuple(d(st.lists(st.one_of(request, decode), min_size=1, max_size=5))),
            num_heads=kv_heads * d(group), num_kv_heads=kv_heads, head_size=d(st.sampled_from(heads)),
            dtype=d(st.sampled_from(dtypes)), block_size=d(st.sampled_from(blocks)),
            block_order=d(st.sampled_from(["permuted", "sequential"])), spare_blocks=d(st.integers(1, 3)),
            sliding_window=d(st.none() | st.integers(1, 24)) if feats.get("sliding_window") else None,
            logits_soft_cap=d(st.none() | st.sampled_from([5.0, 30.0])) if feats.get("logits_soft_cap") else None,
            scale=d(st.none() | st.sampled_from(SCALES)), num_pad_tokens=d(st.integers(0, 4)), history_chunk=d(st.none() | st.integers(1, 12)),
            seed=d(st.integers(0, 2 ** 16)))

    return draw()


def case_problems(backend: type[AttentionBackend], case: ConformanceCase, device: str,
                  name_blocks: bool = True) -> list[str] | None:
    """Every problem of ``case`` on ``backend`` (``None``: the declarations rule it out after
    all, e.g. ``validate_configuration`` rejecting it, which the catalog reports).
    ``name_blocks=False`` skips naming the NaN blocks read (reruns; the search and
    shrinking do not need it)."""
    a = assess(backend, case, device)
    if a.skip_reasons or a.claim_mismatch:
        return None
    run = run_case(backend, case, device, a.kernel_block_size)
    if run.error:
        return [f"running the case raised: {run.error}"]
    from attnplug.plugins.discovery import get_registry

    ref_cls = get_registry().get("torch_native")
    reference = None
    if backend is not ref_cls:
        reference = run_case(ref_cls, case, device, case.kernel_block_size or case.block_size)
        if reference.error:
            return None   # outside what the reference runs: not the backend's problem
    problems = checks.check_outputs(run, reference, name_blocks) + checks.check_cache_writes(run, backend)
    problems += checks.check_metadata_untouched(run) + (checks.check_update_block_table(run) or [])
    return problems
