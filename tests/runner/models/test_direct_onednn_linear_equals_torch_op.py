"""float32 CPU linears through oneDNN's C API directly (``runner/models/onednn.py``,
``_onednn.pyx``, wired in ``runner/models/cpu_linear.py``): the direct path is the one taken
where the ``onednn-cpu-gomp`` wheel is installed (a base dependency on Linux x86-64), its
results are bitwise those of torch's ``_linear_pointwise`` op and close to ``F.linear``, a
weight written in place is packed again, oneDNN shares torch's OpenMP runtime, and without the
library (the switch off, a failing load) torch's op runs, silently."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import platform
import subprocess
import sys

import pytest
import torch

from attnplug.runner.models import cpu_linear, onednn
from attnplug.runner.models.cpu_linear import Linear

WHEEL_PLATFORM = platform.system() == "Linux" and platform.machine() == "x86_64"

pytestmark = [
    pytest.mark.skipif(not cpu_linear.ENABLED, reason="torch built without oneDNN"),
    pytest.mark.skipif(not WHEEL_PLATFORM, reason="onednn-cpu-gomp is a dependency on Linux x86-64 only"),
]


@pytest.fixture(autouse=True)
def _direct_decided_again():
    """Each test starts and ends with the process's own decision (switch, wheel, module)."""
    cpu_linear.use_direct()
    yield
    cpu_linear.use_direct()


def _entry(lin):
    (_, _, held), = lin.packed_weights.values()
    return held


def _torch_op(lin, x):
    packed = torch.ops.mkldnn._reorder_linear_weight(lin.weight.detach(), cpu_linear.PACK_ROWS_HINT)
    return torch.ops.mkldnn._linear_pointwise(x, packed, lin.bias, "none", [], "")


def test_the_direct_path_loads_where_the_wheel_is_a_dependency():
    assert onednn.matmul_module() is not None, onednn.load_error()
    assert onednn.matmul_module().version()[0] == 3


@pytest.mark.parametrize("rows", [1, 7, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_direct_linear_equals_torch_op_bitwise_and_f_linear_closely(rows, bias):
    torch.manual_seed(rows)
    lin = Linear(96, 80, bias=bias)
    x = torch.randn(rows, 96)
    with torch.no_grad():
        y = lin(x)
        assert isinstance(_entry(lin), onednn.matmul_module().Matmul)  # the direct path ran
        assert torch.equal(y, _torch_op(lin, x))
        torch.testing.assert_close(y, torch.nn.functional.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
        y3 = lin(x.view(1, rows, 96))  # leading dimensions flattened into rows
        assert y3.shape == (1, rows, 80) and torch.equal(y3[0], y)


def test_a_weight_written_in_place_or_moved_is_packed_again():
    lin = Linear(32, 24, bias=True)
    x = torch.randn(5, 32)
    with torch.no_grad():
        lin(x)
        first = _entry(lin)
        assert _entry(lin) is first and lin(x) is not None and _entry(lin) is first  # cached
        lin.weight.copy_(torch.randn(24, 32))  # what load_hf_state_dict does
        torch.testing.assert_close(lin(x), torch.nn.functional.linear(x, lin.weight, lin.bias))
        assert _entry(lin) is not first
        lin.to(torch.float64).to(torch.float32)  # new storage
        lin.bias.mul_(2)  # the bias is read at every call, never cached
        torch.testing.assert_close(lin(x), torch.nn.functional.linear(x, lin.weight, lin.bias))


def test_one_openmp_runtime_for_torch_and_onednn_and_a_primitive_per_thread_count():
    lin = Linear(64, 48)
    x = torch.randn(16, 64)
    before = torch.get_num_threads()
    try:
        with torch.no_grad():
            torch.set_num_threads(1)
            y1 = lin(x)
            assert onednn.matmul_module().threads() == 1
            torch.set_num_threads(3)  # more than this machine's cores: not a default anywhere
            assert onednn.matmul_module().threads() == 3
            y3 = lin(x)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(y1, y3)
    assert _entry(lin).threads_of(16) == 3  # remade for the new thread count
    with open("/proc/self/maps") as f:
        gomp = {line.split()[-1] for line in f if "/libgomp" in line}
    assert len(gomp) == 1, gomp


def test_the_switch_off_keeps_torch_op(monkeypatch):
    monkeypatch.setenv(onednn.ENV_SWITCH, "0")
    assert not cpu_linear.use_direct()
    assert onednn.load_error() == "ATTNPLUG_ONEDNN_DIRECT=0"
    lin = Linear(16, 8, bias=False)
    x = torch.randn(3, 16)
    with torch.no_grad():
        y = lin(x)
    assert isinstance(_entry(lin), torch.Tensor)  # torch's packed weight
    torch.testing.assert_close(y, x @ lin.weight.T)


def test_a_failing_load_or_a_missing_wheel_keeps_torch_op(monkeypatch):
    def refuse(path):
        raise OSError(f"dlopen: {path}: cannot open shared object file")

    monkeypatch.setattr(onednn._onednn, "load", refuse)
    assert not cpu_linear.use_direct()
    assert "cannot open shared object file" in onednn.load_error()
    lin = Linear(16, 8)
    with torch.no_grad():
        lin(torch.randn(3, 16))
    assert isinstance(_entry(lin), torch.Tensor)
    monkeypatch.setattr(onednn, "DISTRIBUTION", "onednn-cpu-gomp-absent")
    assert onednn.library_path() is None and not cpu_linear.use_direct()
    assert "not installed" in onednn.load_error()
    with pytest.raises(RuntimeError, match="cannot load"):
        cpu_linear.use_direct(True)


def test_the_library_loader_refuses_a_missing_file_and_a_library_without_the_api():
    """In a fresh process (a library once loaded stays loaded), the compiled module alone."""
    spec = importlib.util.find_spec("attnplug.runner.models._onednn")
    code = (
        "import importlib.machinery as m, importlib.util as u, sys\n"
        f"loader = m.ExtensionFileLoader('_onednn', {spec.origin!r})\n"
        "mod = u.module_from_spec(u.spec_from_loader('_onednn', loader)); loader.exec_module(mod)\n"
        "for path in ('/nonexistent/libdnnl.so.3', 'libm.so.6'):\n"
        "    try:\n"
        "        mod.load(path)\n"
        "    except OSError as e:\n"
        "        print('OSError', e)\n"
        "print('version', mod.version())\n"
        "try:\n"
        "    mod.Matmul(0, 4, 4)\n"
        "except RuntimeError as e:\n"
        "    print('RuntimeError', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True).stdout
    lines = out.splitlines()
    assert lines[0].startswith("OSError dlopen: /nonexistent/libdnnl.so.3"), out
    assert lines[1] == "OSError dnnl_version not found in libm.so.6", out
    assert lines[2] == "version None", out
    assert lines[3].startswith("RuntimeError oneDNN is not loaded"), out


def test_bad_input_falls_back_or_gets_f_linears_error():
    lin = Linear(16, 8, bias=True)
    x = torch.randn(16, 6).T  # [6, 16], not contiguous: torch's op takes it
    with torch.no_grad():
        torch.testing.assert_close(lin(x), torch.nn.functional.linear(x, lin.weight, lin.bias))
        assert not lin.packed_weights.get("weight") or isinstance(_entry(lin), torch.Tensor)
        with pytest.raises(RuntimeError, match="mat1 and mat2 shapes cannot be multiplied"):
            lin(torch.randn(3, 15))
        mm = cpu_linear.direct(lin.weight, cpu_linear.PackedWeights(), "weight")
        with pytest.raises(ValueError, match="m=0 must be >= 1"):
            mm.run(0, 0, 0)
    with pytest.raises(ValueError, match="must be >= 1"):
        onednn.matmul_module().Matmul(lin.weight.data_ptr(), 0, 16)


def test_a_primitive_per_decode_row_count_and_the_last_8_larger_ones():
    """Up to 64 rows one primitive each (kept), above the last 8 row counts (remade from
    oneDNN's primitive cache when a count comes back)."""
    lin = Linear(24, 16, bias=True)
    with torch.no_grad():
        for rows in (*range(1, 75), 100, 300, 65, 1, 64):
            x = torch.randn(rows, 24)
            torch.testing.assert_close(lin(x), torch.nn.functional.linear(x, lin.weight, lin.bias))
            assert torch.equal(lin(x), _torch_op(lin, x))
    mm = _entry(lin)
    assert mm.primitives == 64 + 8
    assert mm.threads_of(64) == mm.threads_of(300) == torch.get_num_threads()
    assert mm.threads_of(66) == 0 and mm.threads_of(0) == 0  # 66 dropped from the ring


def test_a_weight_alternating_between_the_two_paths_is_packed_once_for_each():
    """A non-contiguous ``x`` takes torch's op, a contiguous one the direct path: each keeps its
    own cache entry, so switching back and forth packs nothing again."""
    lin = Linear(16, 8, bias=True)
    contiguous, strided = torch.randn(6, 16), torch.randn(16, 6).T
    with torch.no_grad():
        lin(contiguous), lin(strided)
        tensor, matmul = lin.packed_weights["weight"][2], lin.packed_weights[cpu_linear.direct_key("weight")][2]
        assert isinstance(tensor, torch.Tensor) and isinstance(matmul, onednn.matmul_module().Matmul)
        for x in (contiguous, strided, contiguous, strided):
            torch.testing.assert_close(lin(x), torch.nn.functional.linear(x, lin.weight, lin.bias))
        assert lin.packed_weights["weight"][2] is tensor
        assert lin.packed_weights[cpu_linear.direct_key("weight")][2] is matmul
    assert len(lin.packed_weights) == 2
