"""One estimate, three doors: the CLI (flags), the route (a JSON body) and the node (a ModelPatcher) build a
setup and call memory.estimate.plan, and memory.report words it.  So they give the same figures, the
figures add up, and the request is checked by one validator."""
import json
import re

import pytest
import torch

from wan_sage import __version__, cli
from wan_sage.memory import report, request
from wan_sage.memory.errors import RequestError
from wan_sage.memory.estimate import GiB, POLICIES, plan
from wan_sage.nodes import comfy_bridge, estimator, routes

BODY = {"preset": "wan2.2-a14b", "width": 1280, "height": 720, "frames": 81, "vram_gib": 24, "attention": "sage-auto",
        "arch": "sm90"}
FLAGS = ["plan", "--preset", "wan2.2-a14b", "--width", "1280", "--height", "720", "--frames", "81", "--vram", "24",
         "--attention", "sage-auto", "--arch", "sm90"]


def _cli(capsys, *args):
    code = cli.main([*args])
    out, err = capsys.readouterr()
    return code, out, err


def _route(body):
    status, answer = routes.handle_estimate(body)
    assert status == 200, answer
    return answer


def _gib_after(label: str, text: str) -> float:
    line = next(x for x in text.splitlines() if x.strip().startswith(label))
    return float(re.search(r"([\d.]+) GiB", line[len(line) - len(line.lstrip()) + len(label):]).group(1))


def test_the_cli_table_its_json_and_the_route_give_the_same_figures(capsys):
    _code, table, _err = _cli(capsys, *FLAGS)
    _code, raw, _err = _cli(capsys, *FLAGS, "--json")
    cli_json, answer = json.loads(raw), _route(BODY)
    assert cli_json["estimate"] == json.loads(json.dumps(answer["estimate"]))
    for key in ("activation_gib", "sage_extra_gib", "reservation_gib", "comfy_gib", "offload_gib", "verdict"):
        assert cli_json["summary"][key] == answer["summary"][key], key
    assert _gib_after("activation peak", table) == round(answer["summary"]["activation_gib"], 2)
    assert answer["text"] in table  # the route's text is the CLI's table


def test_the_node_words_its_estimate_as_the_route_does(monkeypatch):
    """A stand-in A14B patcher with the route's budget: the same terms, activation peak and reservation."""
    from test_current_comfy_patcher import Patcher
    monkeypatch.setattr(comfy_bridge, "capacity", lambda model: 24 * GiB)
    monkeypatch.setattr(comfy_bridge, "extra_reserved", lambda: 400 << 20)
    monkeypatch.setattr(comfy_bridge, "vae_dtype_size", lambda dev: 2)   # bf16, as ComfyUI decodes a Wan VAE on CUDA
    # its weights keep their host copies, as the estimator's clone on a GPU: the model is unloaded for the decode
    monkeypatch.setattr(estimator.host_copy, "installed", lambda model: True)
    m = Patcher()
    m.model_size = lambda: request.build(BODY).setup.weights_bytes
    _fn, node = estimator.sampling_plan(m, [1, 16, 21, 90, 160], m.model_options, estimator.Settings())
    route = plan(request.build({**BODY, "attention": "sdpa", "dtype": "bf16"}).setup)
    assert node.resident == route.resident and node.reservation == route.reservation
    assert report.summary(node)["activation_gib"] == report.summary(route)["activation_gib"]


def test_the_budget_adds_up(capsys):
    s = _route(BODY)["summary"]
    assert s["vram_gib"] - s["kept_free_gib"] - s["reservation_gib"] == pytest.approx(s["room_for_weights_gib"])
    assert s["weights_gib"] - s["room_for_weights_gib"] == pytest.approx(s["offload_gib"])
    _code, table, _err = _cli(capsys, *FLAGS)
    kept = _gib_after("kept free by ComfyUI", table)
    room = _gib_after("room for weights", table)
    assert kept == round(s["kept_free_gib"], 2) and room == round(s["room_for_weights_gib"], 2)
    assert f"offloads {s['offload_gib']:.1f} GiB" in table


def test_sage_extra_is_never_negative(capsys):
    """Grouped under compile, Sage's attention phase needs less than compiled SDPA's; the extra is 0, not minus."""
    est = plan(request.build({**BODY, "vram_gib": 80, "compiled": True, "sage_grouped": True}).setup)
    assert est.terms["sage_extra"] < 0 and est.sage_extra == 0
    assert report.summary(est)["sage_extra_gib"] == 0
    _code, table, _err = _cli(capsys, *FLAGS, "--vram", "80", "--compiled", "--sage-grouped")
    line = next(x for x in table.splitlines() if "of which Sage extra" in x)
    assert "-" not in line and line.split()[4:6] == ["0.00", "GiB"]


def test_one_validator_one_message_for_the_route_and_the_cli(capsys):
    for field, flag, value in (("width", "--width", "99999"), ("vram_gib", "--vram", "-3"), ("cfg", "--cfg", "nan")):
        with pytest.raises(RequestError) as e:
            request.build({**BODY, field: float(value)})
        _code, _out, err = _cli(capsys, *FLAGS, flag, value)
        assert err.strip() == f"wan-sage plan: {flag}{str(e.value)[len(field):]}", (err, str(e.value))


def test_unknown_fields_are_named():
    status, answer = routes.handle_estimate({**BODY, "widht": 1280})
    assert (status, answer["field"]) == (400, "widht") and "unknown field 'widht'" in answer["error"]
    assert "docs/route.md" in answer["error"]


def test_a_missing_model_is_said_in_the_answer():
    s = _route({"width": 832, "height": 480, "frames": 81})["summary"]
    assert s["assumed"] and "wan2.2-a14b" in s["assumed"] and s["source"] == "preset wan2.2-a14b (assumed)"
    assert s["assumed"] in s["notes"]
    assert _route(BODY)["summary"]["assumed"] is None


def test_a_latent_of_the_wrong_channel_count_is_a_problem():
    small = {"preset": "wan2.1-1.3b", "width": 832, "height": 480, "frames": 81}
    assert _route({**small, "latent_channels": 16})["summary"]["problems"] == []
    answer = _route({**small, "latent_channels": 48})
    (problem,) = answer["summary"]["problems"]
    assert "48 channels" in problem and "takes 16" in problem and f"problem: {problem}" in answer["text"]
    assert routes.handle_estimate({**small, "latent_channels": "48"})[1]["field"] == "latent_channels"


def test_the_policy_name_earlier_workflows_saved_still_works():
    old = _route({**BODY, "policy": "fixed GB per row", "fixed_gib": 9.5})["summary"]
    new = _route({**BODY, "policy": POLICIES[2], "fixed_gib": 9.5})["summary"]
    assert old == new and old["policy"] == "fixed GiB per row" and old["reservation_gib"] == 9.5
    assert estimator.Settings(policy="fixed GB per row").policy == POLICIES[2]


def test_bare_wan_sage_prints_usage_and_version_works(capsys):
    code, out, err = _cli(capsys)  # no command ran: a usage error, the help on stderr
    assert code == 2 and "usage: wan-sage" in err and "plan" in err and "bench" in err and out == ""
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"wan-sage {__version__}"


def test_the_memory_required_stand_in_is_immutable_and_shared_by_copies():
    import copy
    est_setup = request.build(BODY).setup
    fn = estimator.MemoryRequired(est_setup)
    assert copy.deepcopy(fn) is fn and fn([1, 16, 21, 90, 160]) == plan(est_setup).reservation
    with pytest.raises(AttributeError):
        fn.setup = None
    assert fn(torch.Size([2, 16, 21, 90, 160])) > fn([1, 16, 21, 90, 160])


def test_every_request_field_is_documented():
    from pathlib import Path
    doc = (Path(__file__).resolve().parents[2] / "docs" / "route.md").read_text()
    table = {m for row in doc.splitlines() if row.startswith("| `") for m in re.findall(r"`(\w+)`", row.split("|")[1])}
    assert table == set(request.FIELDS)
