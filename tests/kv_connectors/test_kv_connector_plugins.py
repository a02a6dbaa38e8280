"""Connectors are plugins: the built-in ``redis`` and third-party entry points of the group
``attnplug.kv_connectors`` (one pluggy hook); ``--kv-connector`` / ``--kv-connector-config``."""

from __future__ import annotations

import importlib.metadata
import logging
import textwrap

import pytest

from attnplug.core.errors import ConfigError
from attnplug.core.kv_connector import KVConnectorBase
from attnplug.plugins.kv_connectors import ENTRY_POINT_GROUP, discover_kv_connectors, get_kv_connector
from attnplug.runner.commands.kv_connector_setup import parse_config


def _ep(name, value):
    return importlib.metadata.EntryPoint(name=name, value=value, group=ENTRY_POINT_GROUP)


def test_builtin_and_entry_point_connectors_are_discovered(tmp_path, monkeypatch, caplog):
    (tmp_path / "my_kv_plugin.py").write_text(textwrap.dedent('''
        from attnplug.core.kv_connector import KVConnectorBase
        from attnplug.plugins.kv_connectors.hookspecs import hookimpl

        class Mine(KVConnectorBase):
            name = "mine"

        @hookimpl
        def attnplug_register_kv_connectors(register):
            register("mine", Mine)
            register("redis", Mine)      # taken by the built-in: skipped
            register("notone", object)   # not a connector: skipped
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="attnplug.kv_connectors"):
        found = discover_kv_connectors([_ep("mine", "my_kv_plugin"), _ep("broken", "no_such_module_xyz")])
    assert found["redis"].__module__.endswith("redis_connector")
    assert issubclass(found["mine"], KVConnectorBase) and found["mine"].name == "mine"
    assert "notone" not in found
    text = caplog.text
    assert "already taken" in text and "not a KVConnectorBase" in text and "no_such_module_xyz" in text


def test_unknown_connector_names_the_known_ones():
    with pytest.raises(ConfigError, match="unknown KV connector 'nope'.*redis"):
        get_kv_connector("nope")


def test_connector_config_is_json_or_key_value_pairs():
    assert parse_config('{"url": "redis://h:1/0", "cpu_bytes": 0}') == {"url": "redis://h:1/0", "cpu_bytes": 0}
    assert parse_config("url=redis://h:1/0, timeout_s=0.5,save=false") == {
        "url": "redis://h:1/0", "timeout_s": 0.5, "save": False}
    for bad in ("[1]", "{oops", "url"):
        with pytest.raises(ConfigError):
            parse_config(bad)


def test_run_refuses_bad_connector_flags_in_one_line(capsys):
    from attnplug.runner.commands.run import main

    for flags, needle in [(["--kv-connector", "nope"], "unknown KV connector"),
                          (["--kv-connector", "redis", "--kv-connector-config", "colour=red"], "unknown redis"),
                          (["--kv-connector-config", "url=x"], "without --kv-connector"),
                          (["--kv-connector", "redis", "--async-scheduling"], "synchronous scheduling"),
                          (["--kv-connector", "redis", "--model", "tiny-hybrid"], "needs --prefix-caching"),
                          # run B read run A's fp8 blocks with its own first-batch scales: other tokens
                          (["--kv-connector", "redis", "--kv-cache-dtype", "fp8_e4m3"], "first_batch scales")]:
        status = main(["--model", "tiny-llama", "--num-requests", "1", "--invariance-requests", "0", *flags])
        err = capsys.readouterr().err
        assert status == 2, (flags, err)
        assert needle in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("setting, needle", [("url=http://x", "url 'http://x' must start"),
                                             ("save=maybe", "save must be true or false"),
                                             ("load=2", "load must be true or false"),
                                             ("cpu_bytes=-1", "cpu_bytes must be >= 0"),
                                             ("timeout_s=0", "timeout_s > 0")])
def test_redis_settings_refuse_bad_values_in_one_line(capsys, setting, needle):
    """A URL redis-py cannot parse was a traceback; an unknown boolean word ran silently as false."""
    from attnplug.runner.commands.run import main

    status = main(["--model", "tiny-llama", "--num-requests", "1", "--invariance-requests", "0",
                   "--kv-connector", "redis", "--kv-connector-config", setting])
    err = capsys.readouterr().err
    assert status == 2, err
    assert needle in err and len(err.strip().splitlines()) == 1, err
