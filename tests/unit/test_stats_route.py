"""GET /wan_sage/stats: the ``sage_status`` the Sage panel shows before any run."""
import json

import pytest

from wan_sage.attention import kernels, override
from wan_sage.nodes import routes


def _probe(**kw):
    base = dict(sage_version=None, sage_flavour=None, sage_error="ModuleNotFoundError: No module named 'sageattention'",
                sage_functions=frozenset(), sm90_binding_broken=False, ck_available=False, ck_version=None,
                ck_error="ModuleNotFoundError: No module named 'comfy_kitchen'")
    base.update(kw)
    return kernels.Probe(**base)


@pytest.fixture
def probe(monkeypatch):
    def use(**kw):
        monkeypatch.setattr(kernels, "probe", lambda refresh=False: _probe(**kw))
    return use


def test_not_installed(probe, monkeypatch):
    probe()
    monkeypatch.delattr(override, "self_test_failures", raising=False)
    body = routes.stats_body()
    assert body["sage_status"] == {"sage_version": None, "sage_error": "ModuleNotFoundError: No module named 'sageattention'",
                                   "sm90_binding_broken": False, "ck_available": False, "self_test_failures": {}}
    assert body["sageattention"] is None and "runs" in body
    json.dumps(body)  # what the route sends


def test_installed_build_with_self_test_failures(probe, monkeypatch):
    probe(sage_version="2.2.0", sage_flavour="sage2", sage_error=None, sm90_binding_broken=True, ck_available=True,
          ck_version="0.2.1")
    monkeypatch.setattr(override, "self_test_failures",
                        lambda: {"sage2_sm90": "returned non-finite values (uninitialised output?)"}, raising=False)
    s = routes.stats_body()["sage_status"]
    assert s["sage_version"] == "2.2.0" and s["sm90_binding_broken"] is True and s["ck_available"] is True
    assert s["self_test_failures"] == {"sage2_sm90": "returned non-finite values (uninitialised output?)"}


def test_a_failing_self_test_reader_does_not_break_the_route(probe, monkeypatch):
    probe(sage_version="2.2.0", sage_error=None)

    def broken():
        raise RuntimeError("boom")
    monkeypatch.setattr(override, "self_test_failures", broken, raising=False)
    assert routes.stats_body()["sage_status"]["self_test_failures"] == {}
