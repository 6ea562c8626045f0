"""The internals of dependencies we use are checked at load: an installed version that lacks one
is refused with one line naming the package, what is missing and the tested version."""

import importlib
import sys

import pytest

from cactus_edge import dependencies
from cactus_edge.errors import IncompatibleDependencyError
from cactus_edge.llama import library
from cactus_edge.llama import rpc as backend_rpc


def test_the_installed_uvicorn_has_every_internal_the_connection_guard_overrides():
    from uvicorn.protocols.http.h11_impl import H11Protocol

    from cactus_edge.server import connections

    for name in ("connection_made", "data_received", "send_400_response", "_unset_keepalive_if_required"):
        assert callable(getattr(H11Protocol, name))
    assert issubclass(connections.GuardedH11Protocol, H11Protocol)


def test_a_uvicorn_without_one_of_them_is_refused_at_import(monkeypatch):
    from uvicorn.protocols.http import h11_impl

    from cactus_edge.server import connections

    monkeypatch.delattr(h11_impl.H11Protocol, "_unset_keepalive_if_required")
    with pytest.raises(IncompatibleDependencyError) as raised:
        importlib.reload(connections)
    message = str(raised.value)
    assert message.startswith("uvicorn ") and "lacks _unset_keepalive_if_required" in message
    assert "connection guard" in message and "install uvicorn==0.55.0" in message
    assert raised.value.exit_code == 2 and "\n" not in message
    monkeypatch.undo()
    importlib.reload(connections)  # the real uvicorn loads again


def test_a_llama_cpp_python_without_its_ggml_module_is_refused_for_rpc(monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp._ggml", None)  # import fails as if it were gone
    with pytest.raises(IncompatibleDependencyError, match=r"^llama-cpp-python \S+ has no llama_cpp._ggml"):
        library.ggml_library()


def test_a_libggml_without_a_registry_function_is_refused_by_name(monkeypatch):
    class OldGgml:
        ggml_backend_reg_by_name = staticmethod(lambda name: 0)

    monkeypatch.setattr(backend_rpc, "_bound", None)
    monkeypatch.setattr(library, "ggml_library", lambda: OldGgml())
    with pytest.raises(IncompatibleDependencyError) as raised:
        backend_rpc.rpc_supported()
    assert "without ggml_backend_reg_get_proc_address" in str(raised.value)
    assert "--rpc" in str(raised.value) and "0.3.36" in str(raised.value)


def test_the_installed_versions_are_of_the_tested_series():
    """CI installs from pyproject.toml's ranges: what runs there is the series that was tested."""
    for package, tested in dependencies.TESTED.items():
        series = tested.rsplit(".", 1)[0] + "."
        assert dependencies.installed_version(package).startswith(series), package
