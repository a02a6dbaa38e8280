"""Backend selection: CLI > env > config file > automatic priority, and its errors."""

from __future__ import annotations

import logging

import pytest
import torch

from attnplug.core import AttentionLayerConfig
from attnplug.core.errors import BackendUnsupportedError, ConfigError, UnknownBackendError
from attnplug.plugins import parse_backend_choice, select_backend
from attnplug.plugins.config import choices_from_config

CFG = AttentionLayerConfig(num_heads=4, num_kv_heads=2, head_size=64, block_size=16)
WINDOW = AttentionLayerConfig(num_heads=4, num_kv_heads=2, head_size=64, sliding_window=100)


@pytest.fixture
def reg(make_backend, make_registry):
    from attnplug.backends.torch_native import TorchNativeBackend
    return make_registry(
        TorchNativeBackend,
        make_backend("alpha"),
        make_backend("beta"),
        make_backend("gamma"),
        make_backend("nowindow", supports_sliding_window=False),
        make_backend("ssm", kv_cache_kind="mamba", validate_configuration=classmethod(lambda cls, layer: [])),
    )


def _sel(reg, kind="full_attention", cfg=CFG, **kw):
    kw.setdefault("env", {})
    return select_backend(cfg, kind, registry=reg, **kw)


def _write(tmp_path, name, text):
    (tmp_path / name).write_text(text)
    return tmp_path


@pytest.mark.parametrize("cli, env, config, expected, source", [
    ("alpha", {"ATTNPLUG_BACKEND": "beta"}, 'backend = "gamma"', "alpha", "cli"),
    (None, {"ATTNPLUG_BACKEND": "beta"}, 'backend = "gamma"', "beta", "env"),
    (None, {}, 'backend = "gamma"', "gamma", "config"),
    (None, {}, None, "torch_native", "auto"),
    (None, {"ATTNPLUG_BACKEND": ""}, None, "torch_native", "auto"),
])
def test_precedence(reg, tmp_path, cli, env, config, expected, source):
    if config:
        _write(tmp_path, "attnplug.toml", config)
    r = _sel(reg, cli_choice=cli, env=env, cwd=tmp_path)
    assert (r.name, r.source) == (expected, source)
    assert r.backend_cls is reg.get(expected)


def test_per_kind_beats_default_within_a_source(reg, tmp_path):
    env = {"ATTNPLUG_BACKEND": "alpha", "ATTNPLUG_BACKEND_FULL_ATTENTION": "beta"}
    assert _sel(reg, env=env, cwd=tmp_path).name == "beta"
    assert _sel(reg, "sliding_window", WINDOW, env=env, cwd=tmp_path).name == "alpha"
    r = _sel(reg, cli_choice="alpha,full_attention=gamma", cwd=tmp_path)
    assert (r.name, r.origin) == ("gamma", "--backend full_attention=gamma")
    _write(tmp_path, "attnplug.toml", '[backend]\ndefault = "alpha"\nsliding_window = "gamma"\n')
    assert _sel(reg, "sliding_window", WINDOW, cwd=tmp_path).name == "gamma"
    assert _sel(reg, cwd=tmp_path).name == "alpha"
    assert "attnplug.toml [backend] default" in _sel(reg, cwd=tmp_path).origin


def test_sources_outrank_specificity(reg, tmp_path):
    _write(tmp_path, "attnplug.toml", '[backend]\nfull_attention = "gamma"\n')
    assert _sel(reg, env={"ATTNPLUG_BACKEND": "beta"}, cwd=tmp_path).name == "beta"


def test_pyproject_table_and_attnplug_toml_priority(reg, tmp_path):
    _write(tmp_path, "pyproject.toml", '[project]\nname = "x"\n[tool.attnplug.backend]\ndefault = "beta"\n')
    r = _sel(reg, cwd=tmp_path)
    assert (r.name, r.source) == ("beta", "config") and "[tool.attnplug.backend]" in r.origin
    _write(tmp_path, "attnplug.toml", 'backend = "gamma"\n')
    assert _sel(reg, cwd=tmp_path).name == "gamma"
    assert choices_from_config(tmp_path / "nonexistent").empty


def test_default_only_applies_to_kinds_its_backend_serves(reg, tmp_path):
    env = {"ATTNPLUG_BACKEND": "alpha"}
    r = _sel(reg, "mamba", CFG, env=env, cwd=tmp_path)
    assert (r.name, r.source) == ("ssm", "auto")
    r = _sel(reg, "mamba", CFG, env={**env, "ATTNPLUG_BACKEND_MAMBA": "ssm"}, cwd=tmp_path)
    assert (r.name, r.source) == ("ssm", "env")


def test_explicit_choice_that_cannot_serve_raises_with_reasons(reg, tmp_path):
    with pytest.raises(BackendUnsupportedError) as ei:
        _sel(reg, "sliding_window", WINDOW, env={"ATTNPLUG_BACKEND": "nowindow"}, cwd=tmp_path)
    err = ei.value
    assert err.backend_name == "nowindow"
    assert any("sliding window (100 tokens) not supported" in r for r in err.reasons)
    assert "env ATTNPLUG_BACKEND" in str(err) and "never falls back" in str(err)
    with pytest.raises(ConfigError, match="--backend full_attention=ssm: backend 'ssm' serves mamba caches, not full_attention cache groups"):
        _sel(reg, cli_choice="full_attention=ssm", cwd=tmp_path)


@pytest.mark.parametrize("cli, env, config, where", [
    ("mamba=alpha", {}, None, "--backend"),
    (None, {"ATTNPLUG_BACKEND_MAMBA": "torch_native"}, None, "env ATTNPLUG_BACKEND_MAMBA"),
    (None, {}, '[backend]\nsliding_window = "ssm"\n', "attnplug.toml [backend] sliding_window"),
])
def test_a_per_kind_choice_of_the_wrong_cache_kind_is_refused_whatever_the_model(reg, tmp_path, cli, env, config,
                                                                                 where):
    """Found by a user trial: `mamba = "torch_native"` passed unnoticed for a model without Mamba layers."""
    if config:
        _write(tmp_path, "attnplug.toml", config)
    with pytest.raises(ConfigError, match="serves .* caches, not .* cache groups") as ei:
        _sel(reg, "full_attention", CFG, cli_choice=cli, env=env, cwd=tmp_path)
    assert where in str(ei.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_explicit_cuda_choice_without_cuda_says_why(reg, tmp_path):
    on_cuda = AttentionLayerConfig(num_heads=4, num_kv_heads=2, head_size=64, device="cuda")
    with pytest.raises(BackendUnsupportedError, match="torch.cuda.is_available"):
        _sel(reg, cfg=on_cuda, cli_choice="torch_native", cwd=tmp_path)


def test_unknown_name_lists_known_names(reg, tmp_path):
    with pytest.raises(UnknownBackendError) as ei:
        _sel(reg, cli_choice="nope", cwd=tmp_path)
    assert "nope" in str(ei.value)
    for name in ("alpha", "beta", "torch_native", "ssm"):
        assert name in str(ei.value)
    with pytest.raises(UnknownBackendError):  # an unknown default is an error even for other kinds
        _sel(reg, "mamba", CFG, env={"ATTNPLUG_BACKEND": "nope"}, cwd=tmp_path)


@pytest.mark.parametrize("cli, env, config, where", [
    ("mamba=nope", {}, None, "--backend mamba=nope"),
    ("alpha,sliding_window=nope", {}, None, "--backend sliding_window=nope"),
    (None, {"ATTNPLUG_BACKEND_MAMBA": "nope"}, None, "env ATTNPLUG_BACKEND_MAMBA"),
    (None, {"ATTNPLUG_BACKEND": "full_attention=alpha,mamba=nope"}, None, "env ATTNPLUG_BACKEND"),
    (None, {}, '[backend]\nmamba = "nope"\n', "attnplug.toml [backend] mamba"),
    (None, {}, '[backend]\nsliding_window = "nope"\n', "attnplug.toml [backend] sliding_window"),
    ("alpha", {}, 'backend = "nope"\n', "attnplug.toml [backend] default"),  # overridden by the CLI: still checked
    ("full_attention=alpha", {"ATTNPLUG_BACKEND_FULL_ATTENTION": "nope"}, None, "env ATTNPLUG_BACKEND_FULL_ATTENTION"),
])
def test_every_name_of_every_source_is_checked_and_its_origin_named(reg, tmp_path, cli, env, config, where):
    """A bad name is an error even for a kind that is not selected and in a source a higher one
    overrides; the message says where the name was written."""
    if config:
        _write(tmp_path, "attnplug.toml", config)
    with pytest.raises(UnknownBackendError) as ei:
        _sel(reg, "full_attention", CFG, cli_choice=cli, env=env, cwd=tmp_path)
    msg = str(ei.value)
    assert where in msg and "unknown backend 'nope'" in msg and "known backends: alpha" in msg, msg
    assert ei.value.name == "nope" and where.split(" [")[0].split("=")[0] in ei.value.origin


def test_auto_logs_the_winner_and_each_rejection(make_backend, make_registry, tmp_path, caplog):
    from attnplug.plugins import selection
    unavailable = make_backend("torch_native", is_available=(False, "needs the moon"))
    reg = make_registry(unavailable, make_backend("zeta", supports_sliding_window=False), make_backend("omega"))
    with caplog.at_level(logging.INFO, logger="attnplug.plugins.selection"):
        r = _sel(reg, "sliding_window", WINDOW, cwd=tmp_path)
    assert r.name == "omega" and r.source == "auto"
    assert [rej.backend for rej in r.rejections] == ["torch_native", "zeta"]
    assert "needs the moon" in r.rejections[0].reasons[0]
    (msg,) = [rec.getMessage() for rec in caplog.records if rec.name == selection.logger.name]
    assert "'omega'" in msg and "needs the moon" in msg and "zeta: sliding window" in msg
    assert "rejected torch_native" in r.explain()


def test_auto_with_no_candidate_lists_every_reason(make_backend, make_registry, tmp_path):
    reg = make_registry(make_backend("a1", supports_sliding_window=False),
                        make_backend("a2", supports_sliding_window=False))
    with pytest.raises(BackendUnsupportedError) as ei:
        _sel(reg, "sliding_window", WINDOW, cwd=tmp_path)
    assert len(ei.value.reasons) == 2 and ei.value.reasons[0].startswith("a1: ")


def test_validate_configuration_that_raises_is_a_reason(make_backend, make_registry, tmp_path):
    def boom(cls, layer):
        raise RuntimeError("plugin bug")
    reg = make_registry(make_backend("buggy", validate_configuration=classmethod(boom)), make_backend("ok"))
    r = _sel(reg, cwd=tmp_path)
    assert r.name == "ok" and "RuntimeError: plugin bug" in r.rejections[0].reasons[0]


@pytest.mark.parametrize("text, needle", [
    ("", "empty entry"), ("a,,b", "empty entry"), ("attention=x", "unknown cache-group kind 'attention'"),
    ("mamba=a,mamba=b", "given twice"), ("full_attention=", "expected a backend name"),
])
def test_choice_syntax_errors(text, needle):
    with pytest.raises(ConfigError, match=needle):
        parse_backend_choice(text)


@pytest.mark.parametrize("content, needle", [
    ("backend = [", "not valid TOML"),
    ("[backend]\nattention = 'x'\n", "unknown cache-group kind 'attention'"),
    ("backend = 3\n", "must be a name or a table"),
    ("[backend]\ndefault = ''\n", "expected a backend name"),
])
def test_config_file_errors_name_the_file(reg, tmp_path, content, needle):
    _write(tmp_path, "attnplug.toml", content)
    with pytest.raises(ConfigError, match=needle) as ei:
        _sel(reg, cli_choice="alpha", cwd=tmp_path)  # checked even when the CLI wins
    assert str(tmp_path / "attnplug.toml") in str(ei.value)


def test_env_per_kind_takes_one_name(reg, tmp_path):
    with pytest.raises(ConfigError, match="ATTNPLUG_BACKEND_MAMBA"):
        _sel(reg, env={"ATTNPLUG_BACKEND_MAMBA": "mamba=ssm"}, cwd=tmp_path)


def test_unknown_kind_is_rejected(reg, tmp_path):
    with pytest.raises(ConfigError, match="unknown cache-group kind 'cross'"):
        _sel(reg, "cross", cwd=tmp_path)
