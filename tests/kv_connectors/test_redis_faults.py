"""Faults of the Redis connector: a corrupted, truncated or wrong-layout value, and the server
killed mid-run. Each time the request recomputes, the run completes with the outputs of a
run without the connector, and the fault is counted (and logged once per kind)."""

from __future__ import annotations

import logging

import pytest
import torch

from attnplug.plugins.kv_connectors.block_codec import MAGIC, BlockLayout, decode_block, encode_block


def _fill(redis_server, kv_engines):
    plain, base = kv_engines.run(kv_engines.build("llama", None))
    kv_engines.run(kv_engines.build("llama", redis_server.url))
    keys = redis_server.client.keys("attnplug:kv:*")
    assert keys
    return plain, base, keys


def _rewrite(client, keys, change):
    for k in keys:
        client.set(k, change(client.get(k)))


def _garble(value: bytes) -> bytes:
    """The payload overwritten with 0x7f bytes (float32 3.4e38): loaded unchecked, every
    attention score overflows; the header and length stay as they were."""
    hlen = int.from_bytes(value[len(MAGIC):len(MAGIC) + 4], "big")
    start = len(MAGIC) + 4 + hlen
    return value[:start] + b"\x7f" * (len(value) - start - 32) + value[-32:]


def _relayout(value: bytes) -> bytes:
    """The same block re-encoded as if the writer's cache had K/V outside the block dimension
    (FlashAttention's order): same bytes and length, another declared layout."""
    import json

    hlen = int.from_bytes(value[len(MAGIC):len(MAGIC) + 4], "big")
    h = json.loads(value[len(MAGIC) + 4:len(MAGIC) + 4 + hlen])
    ((dtype, shape),) = [(d, tuple(sh)) for d, sh in h["parts"]]
    layout = BlockLayout(h["kind"], h["block_size"], h["kernel_block_size"], h["sliding_window"],
                         tuple(h["layout_dims"]), ((dtype, shape),), h["num_layers"])
    slices = decode_block(layout, value)
    other = BlockLayout(**{**layout.__dict__, "layout_dims": ("kv", "block", "token", "head", "dim"),
                           "parts": ((dtype, (shape[1], shape[0], *shape[2:])),)})
    return encode_block(other, [[p[0].transpose(0, 1).contiguous()] for p in slices])


@pytest.mark.parametrize("kind, change", [("checksum", _garble), ("truncated", lambda v: v[:len(v) // 2]),
                                          ("layout", _relayout)])
def test_a_bad_value_makes_the_request_recompute_with_identical_outputs(redis_server, kv_engines, caplog,
                                                                        kind, change):
    plain, base, keys = _fill(redis_server, kv_engines)
    _rewrite(redis_server.client, keys, change)
    with caplog.at_level(logging.WARNING, logger="attnplug.kv_connectors"):
        out, s = kv_engines.run(kv_engines.build("llama", redis_server.url))
    kv = s["kv_connector"]
    assert out == plain, f"a {kind} value changed the outputs"
    assert kv["faults"].get(kind, 0) == kv["loads_failed"] > 0 and set(kv["faults"]) == {kind}, kv
    assert kv["tokens_loaded"] == 0 and s["scheduled_tokens"] == base["scheduled_tokens"]
    assert sum(kind in r.getMessage() for r in caplog.records) == 1, "a fault kind is reported once"


def test_the_store_killed_mid_run_costs_compute_not_correctness(redis_server, kv_engines, caplog):
    plain, base, _ = _fill(redis_server, kv_engines)
    setup = kv_engines.build("llama", redis_server.url)
    from attnplug.runner.step.scheduler_output import SamplingParams

    eng = setup.engine
    for i, p in enumerate(kv_engines.PROMPTS):
        eng.add_request(f"r-{i}", p, SamplingParams(max_tokens=6))
    out = eng.scheduler.schedule()  # every admission found its prefix in the store: all load
    assert len(eng.scheduler.kv_loads.loading) == len(kv_engines.PROMPTS) and not out.num_scheduled_tokens
    redis_server.stop()  # between the lookup and the load
    result = eng.runner.execute_model(out)  # starts the loads; at least one fails before it returns
    assert result.kv_connector_output.failed_recving and not result.kv_connector_output.finished_recving
    eng.scheduler.update_from_output(out, result.sampled_token_ids, result.kv_connector_output)
    eng.add_request("late", kv_engines.PROMPTS[0], SamplingParams(max_tokens=6))  # its lookup fails too
    with caplog.at_level(logging.WARNING, logger="attnplug.kv_connectors"):
        results = eng.run()
    s = setup.summary(results, 1.0)
    out = {rid: r.output_token_ids for rid, r in sorted(results.items())}
    kv = s["kv_connector"]
    assert set(kv["faults"]) <= {"store_unavailable"} and kv["faults"], kv
    assert out.pop("late") == plain["r-0"] and out == plain
    assert kv["tokens_loaded"] == 0 and kv["loads_failed"] == len(kv_engines.PROMPTS)
    assert kv["faults"]["store_unavailable"] >= len(kv_engines.PROMPTS) + 1  # the loads and the late lookup
    assert sum("store_unavailable" in r.getMessage() for r in caplog.records) == 1, "reported once, both sides"
    eng.scheduler.kv_connector.close()
    eng.runner.kv_connector.close()


def test_a_dead_store_from_the_start_is_a_run_without_hits(kv_engines):
    plain, base = kv_engines.run(kv_engines.build("llama", None))
    out, s = kv_engines.run(kv_engines.build("llama", "redis://127.0.0.1:1/0", timeout_s=0.2))
    assert out == plain and s["scheduled_tokens"] == base["scheduled_tokens"]
    assert s["kv_connector"]["faults"]["store_unavailable"] > 0


def test_codec_names_each_fault():
    from attnplug.plugins.kv_connectors.block_codec import BlockFault

    layout = BlockLayout("full_attention", 4, 4, None, ("block", "kv", "token", "head", "dim"),
                         (("float32", (1, 2, 4, 2, 8)),), 2)
    slices = [[torch.randn(1, 2, 4, 2, 8)] for _ in range(2)]
    value = encode_block(layout, slices)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(decode_block(layout, value), slices))
    state = BlockLayout("mamba", 4, 4, None, (), (("float32", (6, 3)), ("bfloat16", (2, 4, 8))), 2)
    parts = [[torch.randn(6, 3), torch.randn(2, 4, 8).bfloat16()] for _ in range(2)]
    back = decode_block(state, encode_block(state, parts))
    assert all(torch.equal(x, y) for a, b in zip(back, parts) for x, y in zip(a, b))
    flipped = bytearray(value)
    flipped[len(value) // 2] ^= 1
    for bad, kind in [(bytes(flipped), "checksum"), (value[:-1], "truncated"), (b"xyz", "truncated"),
                      (encode_block(BlockLayout(**{**layout.__dict__, "sliding_window": 8}), slices), "layout")]:
        with pytest.raises(BlockFault) as e:
            decode_block(layout, bad)
        assert e.value.kind == kind
