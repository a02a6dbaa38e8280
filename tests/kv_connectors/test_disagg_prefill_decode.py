"""Prefill/decode disaggregation (``disagg`` connector): a producer engine prefills (one output
token), a consumer engine loads the transferred KV and first token and only decodes — the
same greedy outputs as one engine, and the consumer computes no prompt token.

In process: both engines in this process, the wire an in-memory queue (the codec and mailbox
are the same as over gloo). Slow: ``torchrun --nproc-per-node 2 -m attnplug run``."""

from __future__ import annotations

import itertools
import queue
from types import SimpleNamespace

import pytest

from attnplug.plugins.kv_connectors import disagg_channel as wire
from tests.kv_connectors.conftest import BLOCK, MODELS, PROMPTS
from tests.kv_connectors.conftest import run as run_engine


def _build(role: str | None, cfg_name: str = "llama", num_blocks: int | None = None):
    from attnplug.runner.commands.assemble import build_engine, resolve_backend
    from attnplug.runner.commands.model_loading import build_with_backends

    model = build_with_backends(MODELS[cfg_name], backend=None, block_size=BLOCK, resolve=resolve_backend, seed=3)
    args = SimpleNamespace(model=f"test-{cfg_name}", backend=None, block_size=BLOCK, seed=3, max_model_len=96,
                           max_num_seqs=4, max_num_batched_tokens=16, num_blocks=num_blocks, record_logits=False,
                           force_preemption_every=None, async_scheduling=False, speculative=None,
                           prefix_caching=False, kv_connector="disagg" if role else None,
                           kv_connector_config=f"role={role},timeout_s=5" if role else None)
    return build_engine(args, model=model, requests=False)


def _pair(tamper=lambda data: data):
    """A producer and a consumer wire joined by a queue; ``tamper`` edits each message."""
    q: queue.Queue = queue.Queue()
    prod = wire.PeerChannel("producer", send=lambda d: q.put(tamper(d)))
    cons = wire.PeerChannel("consumer", recv=q.get)
    wire.install(prod)
    wire.install(cons)
    return prod, cons


def _disaggregated(tamper=lambda data: data, consumer_blocks: int | None = None):
    prod, cons = _pair(tamper)
    try:
        pre, ps = run_engine(_build("producer"), max_tokens=1)
        prod.close()
        out, s = run_engine(_build("consumer", num_blocks=consumer_blocks), max_tokens=6)
    finally:
        cons.close(5)
        wire.install(None, "producer")
        wire.install(None, "consumer")
    return pre, ps, out, s


def test_codec_round_trip_and_cut_message():
    blocks = [(0, 0, b"abc"), (0, 1, b"defg"), (1, 0, b"")]
    data = wire.encode_message({"kind": "kv", "req_id": "r-1", "prompt_len": 9}, blocks)
    msg = wire.decode_message(data)
    assert msg.kind == "kv" and msg.req_id == "r-1" and msg.header["prompt_len"] == 9
    assert msg.blocks == [b"abc", b"defg", b""] and [b[:2] for b in msg.header["blocks"]] == [[0, 0], [0, 1], [1, 0]]
    for bad in (data[:-1], data + b"x", b"APKVMSG2" + data[8:], data[:10]):
        with pytest.raises(wire.MessageError):
            wire.decode_message(bad)


def test_mailbox_serves_requests_in_any_order_and_ends():
    prod, cons = _pair()
    try:
        for rid in ("r-0", "r-1"):
            prod.send({"kind": "kv", "req_id": rid, "prompt_len": 1}, [(0, 0, rid.encode())])
            prod.send({"kind": "tokens", "req_id": rid, "first_token": 7})
        assert cons.take("tokens", "r-1", 5).header["first_token"] == 7
        assert cons.take("kv", "r-1", 5).blocks == [b"r-1"]
        assert cons.take("kv", "r-0", 5).blocks == [b"r-0"]
        prod.close()
        assert cons.take("kv", "r-9", 5) is None  # ended: no wait
        cons.close(5)
    finally:
        wire.install(None, "producer")
        wire.install(None, "consumer")


def test_consumer_only_decodes_and_matches_one_engine():
    plain, base = run_engine(_build(None), max_tokens=6)
    pre, ps, out, s = _disaggregated()
    assert {r: t[:1] for r, t in plain.items()} == pre  # the producer's first tokens
    assert out == plain, "decoding from the transferred KV changed the outputs"
    kv = s["kv_connector"]
    prompt_tokens = sum(len(p) for p in PROMPTS)
    assert kv["role"] == "consumer" and kv["prompt_tokens_computed"] == 0, kv
    assert kv["tokens_loaded"] == prompt_tokens and kv["loads_finished"] == len(PROMPTS) and kv["faults"] == {}
    assert s["scheduled_tokens"] == len(PROMPTS) * (6 - 1)  # the decode steps only
    assert ps["kv_connector"]["prompt_tokens_computed"] == prompt_tokens
    assert ps["kv_connector"]["tokens_saved"] == prompt_tokens


def test_a_consumer_short_of_blocks_asks_again_without_rereading_the_wire():
    """16 blocks of 4 tokens: not every prompt fits at once, so admissions that found the
    load but not the blocks are asked again (the first token is kept, not waited for again).
    A loaded request that gives its blocks back to unblock the front one (the scheduler's
    ``kv_load = "dropped"``) computes its prompt here: counted, outputs unchanged."""
    plain, _ = run_engine(_build(None), max_tokens=6)
    _, _, out, s = _disaggregated(consumer_blocks=16)
    kv = s["kv_connector"]
    assert out == plain
    assert kv["lookups"] > len(PROMPTS) and kv["faults"] == {}, kv
    whole_prompts = {sum(len(p) for p, keep in zip(PROMPTS, mask) if keep)
                     for mask in itertools.product((0, 1), repeat=len(PROMPTS))}
    assert kv["loads_finished"] == len(PROMPTS) and kv["prompt_tokens_computed"] in whole_prompts, kv


def test_a_corrupt_block_in_transfer_recomputes_with_identical_outputs():
    """One byte of the first kv message's last block flipped: checksum fault, that request
    computes its prompt on the consumer, outputs unchanged."""
    plain, _ = run_engine(_build(None), max_tokens=6)
    seen = []

    def flip(data: bytes) -> bytes:
        if not seen and wire.decode_message(data).kind == "kv":
            seen.append(1)
            data = data[:-40] + bytes([data[-40] ^ 1]) + data[-39:]
        return data

    _, _, out, s = _disaggregated(flip)
    kv = s["kv_connector"]
    assert out == plain
    assert kv["faults"] == {"checksum": 1} and kv["loads_failed"] == 1, kv
    assert 0 < kv["prompt_tokens_computed"] <= max(len(p) for p in PROMPTS) + 1, kv


def test_refusals_are_one_line_or_config_errors(capsys):
    from attnplug.core.errors import ConfigError
    from attnplug.runner.commands.run import main

    for flags, needle in [(["--kv-connector", "disagg"], "torchrun --nproc-per-node 2"),
                          (["--kv-role", "producer"], "only with --kv-connector disagg")]:
        status = main(["--model", "tiny-llama", "--num-requests", "1", "--invariance-requests", "0", *flags])
        err = capsys.readouterr().err
        assert status == 2, (flags, err)
        assert needle in err and len(err.strip().splitlines()) == 1, err
    with pytest.raises(ConfigError, match="no producer wire"):
        _build("producer")
    prod, _ = _pair()
    try:
        with pytest.raises(ConfigError, match="sliding_window"):
            _build("consumer", "gemma3")
    finally:
        prod.close()  # ends the consumer's receiver thread
        wire.install(None, "producer")
        wire.install(None, "consumer")


@pytest.mark.slow
def test_torchrun_two_ranks_match_one_process():
    """``torchrun --nproc-per-node 2 -m attnplug run --kv-connector disagg``: rank 1's report."""
    import json
    import os
    import shutil
    import socket
    import subprocess
    import sys

    flags = ["--model", "tiny-llama", "--num-requests", "4", "--torch-threads", "1", "--json"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    one = subprocess.run([sys.executable, "-m", "attnplug", "run", *flags], capture_output=True, text=True,
                         env=env, timeout=300)
    assert one.returncode == 0, one.stderr[-2000:]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    two = subprocess.run([torchrun, "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port",
                          str(port), "-m", "attnplug", "run", *flags, "--kv-connector", "disagg"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert two.returncode == 0, two.stderr[-2000:]
    a, b = json.loads(one.stdout), json.loads(two.stdout)
    kv = b["kv_connector"]
    assert b["outputs_digest"] == a["outputs_digest"]
    assert kv["role"] == "consumer" and kv["prompt_tokens_computed"] == 0, kv
    assert kv["tokens_loaded"] == a["prompt_tokens"] and kv["faults"] == {}, kv
