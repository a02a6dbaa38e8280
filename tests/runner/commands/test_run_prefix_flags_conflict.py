"""``attnplug run --prefix-caching --shared-prefixes`` contradicts itself (caching on / the
same workload with caching off): one line, exit 2. The review found it ran silently with
caching on."""

from __future__ import annotations

import pytest

from attnplug.runner.commands.run import main as run_main


def test_prefix_caching_with_shared_prefixes_is_refused(capsys):
    with pytest.raises(SystemExit) as e:
        run_main(["--model", "tiny-llama", "--num-requests", "1", "--prefix-caching", "--shared-prefixes"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "--shared-prefixes" in err and "--prefix-caching" in err, err


@pytest.mark.parametrize("flag", ["--system-prompts", "--system-prompt-len"])
def test_system_prompt_flags_without_the_shared_prefix_workload_are_refused(capsys, flag):
    """They shape the shared-prefix prompts only: alone they used to be ignored silently."""
    assert run_main(["--model", "tiny-llama", "--num-requests", "1", flag, "8"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and flag in err and "--prefix-caching" in err, err
