"""python_backend's configuration: model parameters to engine and host configs, plan files from
the plan command, and the keys fastdecode.ops.serve writes."""
from __future__ import annotations

import json
import re

import pytest

from fastdecode.config import REPO_ROOT, EngineConfig
from python_backend.config import build_configs, model_parameters


# ---- configuration

def test_build_configs_resolves_paths_and_rejects_unknown(tmp_path):
    params = model_parameters({"parameters": {"model": {"string_value": "models/x"}, "dtype": {"string_value": ""},
                                              "max_running": {"string_value": "64"},
                                              "rworkers": {"string_value": "h1:1, h2:2"},
                                              "cancel_poll_ms": {"string_value": "50"}}})
    assert "dtype" not in params
    engine, host = build_configs(params)
    assert engine.model == str(REPO_ROOT / "models/x") and engine.max_running == 64
    assert engine.rworkers == ("h1:1", "h2:2") and engine.attention == "remote"
    assert host.cancel_poll_s == 0.05
    assert build_configs({"model": "/abs/m"})[0].model == "/abs/m"
    with pytest.raises(ValueError, match="unknown model parameter"):
        build_configs({"modle": "x"})
    with pytest.raises(ValueError, match="max_running"):
        build_configs({"max_running": "many"})
    with pytest.raises(ValueError, match="cancel_poll_ms"):
        build_configs({"cancel_poll_ms": "-1"})
    assert host.send_threads == 8 and build_configs({"send_threads": "3"})[1].send_threads == 3
    for bad in ("0", "-2", "x", "1.5", "65", ""):
        with pytest.raises(ValueError, match="send_threads"):
            build_configs({"send_threads": bad})
    assert build_configs({"kv_format": "int4", "kv_int4_fp16_tail": "off"})[0].kv_int4_fp16_tail is False
    assert build_configs({"kv_int4_fp16_tail": " True "})[0].kv_int4_fp16_tail is True
    for bad in ("maybe", "", "2"):
        with pytest.raises(ValueError, match="kv_int4_fp16_tail"):
            build_configs({"kv_int4_fp16_tail": bad})
    groups = build_configs({"kv_format": "int4", "kv_int4_k_group": "16", "kv_int4_v_group": "128"})[0]
    assert (groups.kv_int4_k_group, groups.kv_int4_v_group) == (16, 128)
    for bad in ("48", "x", "", "3.5"):
        with pytest.raises(ValueError, match="kv_int4_v_group"):
            build_configs({"kv_int4_v_group": bad})


def write_real_plan(tmp_path, seq_len=512) -> tuple[Path, dict]:
    """A plan file written by the real `plan` command (fastdecode.ops.plan.main) from a small
    linear perf model (T(B) = 2 ms + 10 us * B, as tests/test_perfmodel.py)."""
    from fastdecode.ops.plan import main
    from fastdecode.perfmodel import Curve, PerfModel

    xs = (1, 16, 64, 256, 1024)
    pm = PerfModel(8, Curve.of({x: 2e-3 + 1e-5 * x for x in xs}), Curve.of({x: 1e-3 + 1e-6 * x for x in xs}),
                   5e-8, 1e-4, {"device": "synthetic", "shape": {"num_kv_heads": 2, "head_dim": 16}})
    pm.save(tmp_path / "perf.json")
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    out = tmp_path / "plan.json"
    assert main(["plan", "--model", str(model_dir), "--perf", str(tmp_path / "perf.json"),
                 "--seq-len", str(seq_len), "--out", str(out)]) == 0
    return out, json.loads(out.read_text())


def test_plan_file_from_the_plan_command_configures_the_engine(tmp_path):
    path, doc = write_real_plan(tmp_path)
    engine, _ = build_configs({"plan": str(path)})
    p = doc["plan"]
    assert (engine.scheduler, engine.max_running, engine.num_minibatches) == ("sls", p["max_running"],
                                                                                p["num_minibatches"])
    assert (engine.sls_f, engine.sls_w_lim, engine.sls_target_len) == (p["sls_f"], p["sls_w_lim"], 512)
    # config.pbtxt's own values sit above the plan's
    engine, _ = build_configs({"plan": str(path), "sls_f": "16", "scheduler": "fcfs"})
    assert (engine.sls_f, engine.scheduler, engine.max_running) == (16, "fcfs", p["max_running"])
    # relative paths resolve against the checkout, as `make serve SERVE_ARGS="--param plan=..."` passes them
    rel = path.relative_to(tmp_path)
    assert build_configs({"plan": str(rel)}, root=tmp_path)[0].sls_w_lim == p["sls_w_lim"]


def test_checked_in_plan_file_is_read():
    path = REPO_ROOT / "bench" / "results" / "plan.json"
    if not path.exists():
        pytest.skip("no bench/results/plan.json (make plan writes it)")
    engine, _ = build_configs({"plan": "bench/results/plan.json"})
    assert engine.scheduler == "sls"
    assert engine.sls_w_lim == json.loads(path.read_text())["settings"]["sls_w_lim"]


@pytest.mark.parametrize("doc, message", [
    ("not json", "cannot read a JSON object"),
    ("[1, 2]", "expected a JSON object"),
    ({"config": {"max_running": 512, "scheduler": "sls"}}, 'no "settings"'),      # not what plan writes
    ({"settings": {}, "plan": {}}, 'no "settings"'),
    ({"settings": [["max_running", 4]]}, 'no "settings"'),
    ({"settings": {"max_running": 8, "batch_per_minibatch": 4}}, r"unknown setting\(s\) \['batch_per_minibatch'\]"),
    ({"settings": {"max_running": "many"}}, 'max_running="many" is not a valid int'),
    ({"settings": {"max_running": 8.5}}, "max_running=8.5 is not a valid int"),
    ({"settings": {"max_running": True}}, "max_running=true is not a valid int"),
    ({"settings": {"scheduler": 2}}, "scheduler=2 is not a valid str"),
    ({"settings": {"rworkers": "a:1"}}, "rworkers=\"a:1\" is not a valid tuple"),
    ({"settings": {"rworker_timeout_s": None}}, "rworker_timeout_s=null is not a valid float"),
    ({"settings": {"scheduler": "lifo"}}, "its settings \\(scheduler\\) are not valid here: .*scheduler must be"),
    ({"settings": {"sls_f": 0, "max_running": 4}}, "are not valid here: .*sls_f must be >= 1"),
])
def test_bad_plan_files_are_rejected_clearly(tmp_path, doc, message):
    path = tmp_path / "plan.json"
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    with pytest.raises(ValueError, match=f"plan {re.escape(str(path))}: .*{message}"):
        build_configs({"plan": str(path)})


def test_plan_is_not_blamed_for_a_bad_explicit_parameter(tmp_path):
    path, _ = write_real_plan(tmp_path)
    with pytest.raises(ValueError, match="kv_format") as e:
        build_configs({"plan": str(path), "kv_format": "fp3"})
    assert "plan" not in str(e.value)
    with pytest.raises(ValueError, match="plan .*missing.json: cannot read"):
        build_configs({"plan": str(tmp_path / "missing.json")})


def test_engine_config_from_dict_still_accepts_what_serve_writes():
    # fastdecode.ops.serve writes these keys into config.pbtxt; EngineConfig must accept them.
    cfg = EngineConfig.from_dict({"model": "m", "attention": "remote", "rworkers": "a:1,b:2"})
    assert cfg.rworkers == ("a:1", "b:2")
