"""``attnplug serve``'s flags are ``run``'s (replay flags refused, one line, exit 2), and
``attnplug bench serve`` drives a server with ``run``'s load: the completions equal the
in-process replay's, token for token."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("openai")

sys.path.insert(0, str(Path(__file__).parent))
from server_fixtures import running_server  # noqa: E402

FLAGS = ["--model", "tiny-llama", "--max-model-len", "256", "--max-num-seqs", "4", "--max-num-batched-tokens", "64"]


def test_replay_flags_are_refused(capsys):
    from attnplug.runner.commands import serve

    with pytest.raises(SystemExit) as e:
        serve.parse(["--model", "tiny-llama", "--request-rate", "4"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--request-rate" in err and "replay" in err
    with pytest.raises(SystemExit) as e:
        serve.parse(["--help"])
    helptext = capsys.readouterr().out
    assert e.value.code == 0 and "--max-queue-len" in helptext and "--backend" in helptext
    assert "--request-rate" not in helptext  # refused, so not listed
    args = serve.parse(FLAGS + ["--async-scheduling", "--port", "0"])  # run's engine flags, parsed by run's parser
    assert args.async_scheduling and args.max_num_seqs == 4 and args.port == 0


@pytest.mark.slow  # two engines and a server: ~8 s on a loaded 2-core machine
def test_bench_serve_matches_the_replay(capsys):
    from attnplug.runner.commands.bench.serve_client import main

    with running_server(FLAGS) as (srv, app):
        assert main(["--base-url", srv.url, *FLAGS, "--num-requests", "4", "--output-len", "6", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["identical_texts"] == "4/4"
    assert out["server"]["completed"] == out["replay"]["completed"] == 4
    assert out["server"]["total_output_tokens"] == out["replay"]["total_output_tokens"] == 24
    assert out["server"]["torch_threads"] == out["replay"]["torch_threads"]
