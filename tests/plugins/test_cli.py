"""`attnplug backends` and `attnplug check`."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from attnplug.plugins import reset_registry
from attnplug.runner.commands.check import parse as check_parse
from attnplug.runner.commands.check import pytest_args
from attnplug.runner.commands.cli import main as cli


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch, tmp_path):
    for var in ("ATTNPLUG_PLUGINS", "ATTNPLUG_DISABLE_PLUGINS", "ATTNPLUG_BACKEND",
                "ATTNPLUG_BACKEND_FULL_ATTENTION", "ATTNPLUG_BACKEND_SLIDING_WINDOW", "ATTNPLUG_BACKEND_MAMBA"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.chdir(tmp_path)
    reset_registry()
    yield
    reset_registry()


def _json(capsys, *argv) -> tuple[int, dict]:
    rc = cli(list(argv))
    return rc, json.loads(capsys.readouterr().out)


def test_backends_table_and_json(capsys):
    assert cli(["backends"]) == 0
    out = capsys.readouterr().out
    assert "torch_native" in out and "built-in" in out and "yes" in out
    rc, data = _json(capsys, "backends", "--json")
    (row,) = [r for r in data["backends"] if r["name"] == "torch_native"]
    assert row["builtin"] and row["available"] and row["features"]["sliding_window"]
    assert row["plugin_api_version"] == "1.0" and row["dtypes"] == ["float32", "float16", "bfloat16"]


def test_backends_json_reports_plugin_faults(capsys, dists):
    mod = dists.module_name("brokenplug")
    dists.add("broken-dist", "3.1", {"brokenplug": mod}, {mod: "raise RuntimeError('cannot import me')\n"})
    rc, data = _json(capsys, "backends", "--json")
    (fault,) = data["faults"]
    assert fault["plugin"] == "brokenplug" and fault["distribution"] == "broken-dist 3.1"
    assert "cannot import me" in fault["reason"] and fault["entry_point"] == f"brokenplug = {mod}"
    cli(["backends"])
    out = capsys.readouterr().out
    assert "plugin problems" in out and "brokenplug" in out


def test_explain_preset(capsys):
    rc, report = _json(capsys, "backends", "--explain", "--model", "preset", "--device", "cpu", "--json")
    assert rc == 0
    (group,) = report["groups"]
    assert group["kind"] == "full_attention" and group["chosen"] == "cpu_sdpa" and group["source"] == "auto"
    assert group["num_layers"] == 4
    assert cli(["backends", "--explain", "--model", "preset", "--device", "cpu"]) == 0
    assert "chosen: cpu_sdpa" in capsys.readouterr().out


def test_explain_hf_config_with_window_softcap_and_mamba(capsys, tmp_path):
    cfg = {"model_type": "hybrid_demo", "num_hidden_layers": 6, "num_attention_heads": 8, "num_key_value_heads": 4,
           "head_dim": 64, "hidden_size": 512, "sliding_window": 100, "attn_logit_softcapping": 50.0,
           "layer_types": ["sliding_attention", "full_attention", "mamba", "sliding_attention", "full_attention",
                           "mamba"]}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    rc, report = _json(capsys, "backends", "--explain", "--model", str(path), "--device", "cpu", "--json")
    kinds = {g["kind"]: g for g in report["groups"]}
    assert set(kinds) == {"sliding_window", "full_attention", "mamba"}
    assert kinds["sliding_window"]["chosen"] == "cpu_sdpa" and kinds["sliding_window"]["num_layers"] == 2
    assert "sliding_window=100" in kinds["sliding_window"]["layer"] and "logits_soft_cap=50.0" in kinds["full_attention"]["layer"]
    assert kinds["mamba"]["chosen"] == "mamba2_torch" and kinds["mamba"]["num_layers"] == 2
    assert rc == 0


def test_explain_errors(capsys):
    assert cli(["backends", "--explain"]) == 2
    assert "--model" in capsys.readouterr().err
    assert cli(["backends", "--explain", "--model", "preset", "--backend", "nope"]) == 2
    err = capsys.readouterr().err
    assert "known backends: " in err and "torch_native" in err.split("known backends: ")[1]
    assert cli(["backends", "--explain", "--model", "no/such/config.json"]) == 2
    assert "neither a preset" in capsys.readouterr().err


def test_check_builds_an_isolated_pytest_command():
    args = check_parse(["a", "b", "--device", "cpu", "-k", "mixed", "-x", "-v", "--", "--tb=short"])
    assert args.verbose == 1 and args.pytest_args == ["--tb=short"]
    out = pytest_args(args, "/tmp/x/pytest.ini")
    assert out[:3] == ["-c", "/tmp/x/pytest.ini", "--rootdir"] and out[3].endswith("conformance")
    assert ["--attnplug-backend", "a"] == out[out.index("a") - 1: out.index("a") + 1]
    assert "b" in out and "--tb=short" in out and out[out.index("-k") + 1] == "mixed"
    assert out[out.index("--pyargs") + 1] == "attnplug.plugins.conformance"


def test_attnplug_check_torch_native_passes(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # tiny tensors: one thread avoids oversubscription
    res = subprocess.run([sys.executable, "-m", "attnplug", "check", "torch_native"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    assert " passed" in res.stdout and "failed" not in res.stdout


def _check_refused(capsys, monkeypatch, *argv) -> tuple[int, str]:
    """Run ``attnplug check`` in-process; pytest must not be started (the refusal is up-front)."""
    monkeypatch.setattr(pytest, "main", lambda *a, **k: pytest.fail("pytest.main ran"))
    rc = cli(["check", *argv])
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("attnplug check: "), err
    return rc, err


def test_check_refuses_a_backend_that_cannot_run_here(capsys, monkeypatch):
    from attnplug.runner.commands.check import EXIT_NOTHING_TESTED
    from attnplug.plugins.conformance.pytest_plugin import EXIT_NOTHING_TESTED as PLUGIN_CODE

    assert EXIT_NOTHING_TESTED == PLUGIN_CODE == 6
    monkeypatch.syspath_prepend(os.path.dirname(__file__))
    rc, err = _check_refused(capsys, monkeypatch, "broken_backends:Unavailable")
    assert rc == EXIT_NOTHING_TESTED and "is_available() is False: needs the moon" in err
    rc, err = _check_refused(capsys, monkeypatch, "torch_native", "broken_backends_more:OtherCacheKind")
    assert rc == EXIT_NOTHING_TESTED and "OtherCacheKind'" in err and "mamba (state), mla and indexer (selector) cases only" in err
    from attnplug.plugins import get_backend
    for name in ("flash_attn", "triton"):  # the trial's cases, where they cannot run
        ok, why = get_backend(name).is_available()
        if not ok:
            rc, err = _check_refused(capsys, monkeypatch, name)
            assert rc == EXIT_NOTHING_TESTED and why in err


def test_check_bad_arguments_exit_2_before_pytest(capsys, monkeypatch):
    import torch

    rc, err = _check_refused(capsys, monkeypatch, "no_such_backend")
    assert rc == 2 and "unknown backend 'no_such_backend'" in err and "torch_native" in err
    rc, err = _check_refused(capsys, monkeypatch, "torch_native", "--device", "gpu")
    assert rc == 2 and "--device 'gpu' is not a device" in err
    if not torch.cuda.is_available():
        rc, err = _check_refused(capsys, monkeypatch, "torch_native", "--device", "cuda")
        assert rc == 2 and "--device cuda requested but torch.cuda.is_available() is False" in err


def test_check_without_pytest_says_to_install_the_test_extra(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "pytest", None)  # `import pytest` now raises ModuleNotFoundError
    assert cli(["check", "torch_native"]) == 2
    err = capsys.readouterr().err
    assert "pytest is not installed" in err and "pip install 'attnplug[test]'" in err and "make test" in err


def test_explain_renders_its_markup_escapes_ours_and_exits_1_without_a_backend(capsys, tmp_path):
    (tmp_path / "attnplug.toml").write_text('[backend]\ndefault = "torch_native"\nfull_attention = "flash_attn"\n')
    rc = cli(["backends", "--explain", "--model", "tiny-hybrid", "--device", "cpu"])
    out = " ".join(capsys.readouterr().out.split())  # rich wraps long lines
    assert rc == 1, out  # flash_attn takes no float32: the full-attention group has no backend
    assert "[red]" not in out and " no backend: backend 'flash_attn' cannot serve" in out
    assert f"({tmp_path / 'attnplug.toml'} [backend] default)" in out  # "[backend]" is text, not a tag
    assert "(sliding_window, 1 layer: " in out and "(mamba, 2 layers: " in out
    assert cli(["backends", "--explain", "--model", "tiny-hybrid", "--device", "cpu", "--json"]) == 1


@pytest.mark.parametrize("argv", [["backends", "--json"], ["backends"]])
def test_backends_into_a_closed_pipe_ends_quietly(tmp_path, argv):
    proc = subprocess.Popen([sys.executable, "-m", "attnplug", *argv], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141 and err == "", err[-2000:]


MALFORMED_PLUGIN = '''
from attnplug.plugins import hookimpl
from attnplug.backends.torch_native import TorchNativeBackend

class NoDevices(TorchNativeBackend):
    supported_devices = None
    @classmethod
    def get_name(cls):
        return "no_devices"

class Fine(TorchNativeBackend):
    @classmethod
    def get_name(cls):
        return "fine_backend"

@hookimpl
def attnplug_register_backends(registry):
    registry.register(NoDevices)
    registry.register(Fine)
'''


def test_a_malformed_declaration_is_that_backends_fault_and_the_listing_goes_on(capsys, dists):
    mod = dists.module_name("malformed")
    dists.add("malformed-dist", "1.0", {"malformed": mod}, {mod: MALFORMED_PLUGIN})
    rc, data = _json(capsys, "backends", "--json")
    assert rc == 0 and {"torch_native", "fine_backend"} <= {r["name"] for r in data["backends"]}
    (fault,) = data["faults"]
    assert fault["backend"] == "NoDevices" and fault["distribution"] == "malformed-dist 1.0"
    assert "NoDevices.supported_devices must be a tuple of device type names (str), got None" in fault["reason"]
    assert cli(["backends"]) == 0
    out = capsys.readouterr().out
    assert "fine_backend" in out and "plugin problems" in out and "NoDevices" in out


def test_a_row_that_still_cannot_be_made_is_listed_as_unavailable(make_backend, make_registry):
    from attnplug.runner.commands.backends import backend_rows

    reg = make_registry(make_backend("changes_later"), make_backend("steady"))
    reg.get("changes_later").supported_head_sizes = 5  # after registration: not iterable
    rows = {r["name"]: r for r in backend_rows(reg)}
    assert rows["steady"]["available"] and not rows["changes_later"]["available"]
    assert rows["changes_later"]["unavailable_reason"].startswith("its declarations raised TypeError")


UNBUILDABLE_PLUGIN = '''
from attnplug.plugins import hookimpl
from attnplug.backends.torch_native import TorchNativeBackend, TorchNativeMetadataBuilder

class ExplodingBuilder(TorchNativeMetadataBuilder):
    def __init__(self, *args, **kwargs):
        raise RuntimeError("no buffers for you")

def backend(name, **methods):
    ns = {"get_name": classmethod(lambda cls: name)}
    ns.update({k: classmethod(v) for k, v in methods.items()})
    return type(name, (TorchNativeBackend,), ns)

def _raise(cls):
    raise ImportError("kernel library missing")

NoBuilder = backend("no_builder", get_builder_cls=lambda cls: None)
RaisingGetter = backend("raising_getter", get_builder_cls=_raise)
RaisingBuilder = backend("raising_builder", get_builder_cls=lambda cls: ExplodingBuilder)
NoImpl = backend("no_impl", get_impl_cls=lambda cls: 42)

@hookimpl
def attnplug_register_backends(registry):
    for b in (NoBuilder, RaisingGetter, RaisingBuilder, NoImpl):
        registry.register(b)
'''


@pytest.mark.parametrize("name, what", [
    ("no_builder", "backend 'no_builder' selected for the full_attention cache group (chosen by --backend): "
                   "get_builder_cls() returned None, not a class"),
    ("raising_getter", "backend 'raising_getter' selected for the full_attention cache group (chosen by --backend): "
                       "get_builder_cls() raised ImportError: kernel library missing"),
    ("raising_builder", "backend 'raising_builder' selected for cache group 0 (full_attention): its builder "
                        "raised RuntimeError: no buffers for you"),
    ("no_impl", "get_impl_cls() returned 42, not a class"),
])
def test_a_selected_backend_that_cannot_be_built_is_one_line(capsys, dists, name, what):
    mod = dists.module_name("unbuildable")
    dists.add("unbuildable-dist", "0.1", {"unbuildable": mod}, {mod: UNBUILDABLE_PLUGIN})
    assert cli(["run", "--model", "tiny-llama", "--backend", name, "--num-requests", "1"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err[-2000:]
    assert err.startswith("attnplug run: ") and what in err, err


def _broken_dist(dists) -> str:
    """A distribution whose module raises at import, on its line 2; returns the module name."""
    mod = dists.module_name("tbplug")
    dists.add("tb-dist", "1.0", {"tbplug": mod}, {mod: "import os\nraise RuntimeError('boom at import')\n"})
    return mod


def test_a_plugin_fault_keeps_its_file_line_and_traceback(capsys, dists):
    mod = _broken_dist(dists)
    assert cli(["backends"]) == 0
    out = capsys.readouterr().out
    assert f"{mod}.py:2" in "".join(out.split()), out  # the fault line names the file and line
    assert "Traceback (most recent call last)" not in out and "--traceback" in out
    assert cli(["backends", "--traceback"]) == 0
    out = capsys.readouterr().out
    assert "Traceback (most recent call last)" in out and "RuntimeError: boom at import" in out
    rc, data = _json(capsys, "backends", "--json")
    (fault,) = data["faults"]
    assert fault["location"].endswith(f"{mod}.py:2") and "boom at import" in fault["traceback"]


def test_unknown_backend_mentions_a_plugin_that_failed_to_load(dists):
    from attnplug.core.errors import UnknownBackendError
    from attnplug.plugins import get_registry

    with pytest.raises(UnknownBackendError) as clean:
        get_registry().get("tb_backend")
    assert "fault" not in str(clean.value)
    reset_registry()
    mod = _broken_dist(dists)
    with pytest.raises(UnknownBackendError) as info:
        get_registry().get("tb_backend")
    msg = str(info.value)
    assert "known backends: " in msg and "'tbplug'" in msg and "boom at import" in msg and f"{mod}.py:2" in msg


def test_backends_strict_exits_non_zero_on_a_plugin_fault(capsys, dists):
    assert cli(["backends", "--strict"]) == 0
    _broken_dist(dists)
    reset_registry()
    assert cli(["backends", "--strict"]) == 3
    assert "--strict: 1 plugin fault" in capsys.readouterr().err
    assert cli(["backends"]) == 0  # without --strict a fault is reported, not fatal


def test_backends_table_fits_100_columns(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    assert cli(["backends"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert max(map(len, lines)) <= 100, max(lines, key=len)
    assert any("torch_native" in line and "1.0" in line for line in lines)  # the last column is not cropped
