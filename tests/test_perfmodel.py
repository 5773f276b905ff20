"""Performance model math on synthetic curves (no timing assertions), the plan CLI,
and one tiny real measurement."""
from __future__ import annotations

import json
import math

import pytest

from fastdecode.config import EngineConfig
from fastdecode.ops.plan import main
from fastdecode.perf_measure import measure_r_part, measure_s_part
from fastdecode.perfmodel import Curve, PerfModel, fit_line, floor_model, plan
from fastdecode.scheduler import create_scheduler
from fastdecode.scheduler.sls import SLSScheduler

A, B_SLOPE = 2e-3, 1e-5          # T(B) = 2 ms + 10 us * B per layer-step


def linear_model(a=A, b=B_SLOPE, r=5e-8, layers=32, xs=(1, 16, 64, 256, 1024, 4096)) -> PerfModel:
    t = Curve.of({x: a + b * x for x in xs})
    h = Curve.of({x: 1e-3 + 1e-6 * x for x in xs})
    return PerfModel(layers, t, h, r, 1e-4, {"device": "synthetic", "shape": {"num_kv_heads": 8, "head_dim": 128}})


def test_fit_line_and_curve():
    a, b = fit_line([1, 2, 3, 4], [3, 5, 7, 9])
    assert a == pytest.approx(1) and b == pytest.approx(2)
    c = Curve.of({1: 1.0, 3: 2.0, 7: 10.0})
    assert c(1) == 1.0 and c(2) == pytest.approx(1.5) and c(5) == pytest.approx(6.0)
    assert c(9) == pytest.approx(14.0)              # last segment extended
    assert c.to_dict()["fit"]["b"] > 0
    assert Curve.from_dict(c.to_dict()) == c
    assert Curve.of([(4, 2.0)])(8) == pytest.approx(4.0)


@pytest.mark.parametrize("xs,ys", [((), ()), ((1, 2), (1.0,)), ((2, 1), (1.0, 2.0)), ((1, 1), (1.0, 2.0)),
                                   ((0, 2), (1.0, 2.0)), ((1, 2), (-1.0, 2.0)), ((1, 2), (float("nan"), 1.0))])
def test_curve_rejects_garbage(xs, ys):
    with pytest.raises(ValueError):
        Curve(xs, ys)


def test_knee_of_efficiency():
    pm = linear_model()
    p = plan(pm, seq_len=1024, max_batch=4096)
    # E(B) = B / (a + bB) rises to 1/b; knee = smallest B with E(B) >= 0.9 * E(4096).
    e_max = 4096 / (A + B_SLOPE * 4096)
    expected = next(b for b in range(1, 4097) if b / (A + B_SLOPE * b) >= 0.9 * e_max)
    assert p["batch_per_minibatch"] == expected
    assert p["T_B_ms"] == pytest.approx((A + B_SLOPE * expected) * 1e3)
    # default max_batch = the largest measured batch
    assert plan(pm, 1024)["batch_per_minibatch"] == expected


def test_latency_budget_picks_largest_batch():
    pm = linear_model()
    n, s, budget = 32, 1024, 200.0
    p = plan(pm, s, latency_budget_s=budget)
    b = p["batch_per_minibatch"]
    assert 2 * n * s * (A + B_SLOPE * b) <= budget < 2 * n * s * (A + B_SLOPE * (b + 1))
    assert b == math.floor((budget / (2 * n * s) - A) / B_SLOPE)
    # a budget beyond the measured range stops at max_batch
    assert plan(pm, s, latency_budget_s=1e9, max_batch=300)["batch_per_minibatch"] == 300
    with pytest.raises(ValueError, match="batch 1"):
        plan(pm, s, latency_budget_s=0.01)


def test_rworkers_f_and_w_lim():
    pm = linear_model(r=2e-7)
    s = 1024
    p = plan(pm, s, latency_budget_s=200.0)
    b = p["batch_per_minibatch"]
    t = A + B_SLOPE * b
    assert p["rworkers_exact"] == pytest.approx(b * s * 2e-7 / (2 * t))
    assert p["rworkers"] == math.ceil(p["rworkers_exact"])
    assert p["sls_f"] == s // 32
    assert p["max_running"] == 2 * b
    assert p["sls_w_lim"] == math.ceil(2 * b * (s + s // 32) / 2) + s     # + one sequence, as sls.py derives
    assert p["kv_tokens_per_rworker"] == math.ceil(p["sls_w_lim"] / p["rworkers"])
    # tokens/s: max_running over the predicted mean step, pipelined
    step = pm.step_time(2 * b, 2 * b * s // 2, p["rworkers"], 2, overlap=True)
    assert p["predicted_tokens_per_s"] == pytest.approx(2 * b / step)
    assert plan(pm, s, latency_budget_s=200.0, num_minibatches=1)["max_running"] == b


def test_step_time_overlap_and_serial():
    pm = linear_model(r=1e-7, layers=10)
    batch, ctx = 64, 64 * 500
    t = A + B_SLOPE * 32                     # two mini-batches of 32
    r = 1e-4 + 1e-7 * ctx / 2
    head = 1e-3 + 1e-6 * 64
    assert pm.step_time(batch, ctx, 1, 2, overlap=False) == pytest.approx(10 * 2 * (t + r) + head)
    assert pm.step_time(batch, ctx, 1, 2, overlap=True) == pytest.approx(10 * max(2 * t, 2 * r) + head)
    t64, r64 = A + B_SLOPE * 64, 1e-4 + 1e-7 * ctx
    assert pm.step_time(batch, ctx, 1, 1, overlap=True) == pytest.approx(10 * (t64 + r64) + head)   # no pipeline
    r4 = 1e-4 + 1e-7 * ctx / 2 / 4
    assert pm.step_time(batch, ctx, 4, 2, overlap=False) == pytest.approx(10 * 2 * (t + r4) + head)


def test_settings_feed_engine_config_and_scheduler(tmp_path):
    pm = linear_model()
    pm.save(tmp_path / "perf.json")
    out = tmp_path / "plan.json"
    model_dir = tmp_path / "m"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    assert main(["plan", "--model", str(model_dir), "--perf", str(tmp_path / "perf.json"), "--seq-len", "512",
                 "--latency-budget", "100000", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    cfg = EngineConfig.from_dict({k: str(v) for k, v in doc["settings"].items()})
    assert cfg.scheduler == "sls" and cfg.sls_target_len == 512 and cfg.max_running == doc["plan"]["max_running"]
    sched = create_scheduler(cfg)
    assert isinstance(sched, SLSScheduler) and sched.w_lim() == doc["plan"]["sls_w_lim"]
    assert doc["plan"]["kv_bytes_per_rworker"] == doc["plan"]["kv_tokens_per_rworker"] * 2 * 2 * 32 * 8 * 128
    assert PerfModel.from_dict(doc["perf_model"]) == pm


@pytest.mark.parametrize("args,msg", [
    (["--latency-budget", "-5"], "must be > 0"), (["--latency-budget", "abc"], "not a valid float"),
    (["--latency-budget", "nan"], "must be > 0"), (["--seq-len", "0"], "must be > 0"),
    (["--seq-len", "1.5"], "not a valid int"), (["--batches", "4,x"], "comma-separated"),
    (["--batches", "0,4"], ">= 1"), (["--num-minibatches", "3"], "invalid choice"),
])
def test_cli_rejects_garbage_args(tmp_path, capsys, args, msg):
    with pytest.raises(SystemExit) as e:
        main(["plan", "--model", str(tmp_path)] + args)
    assert e.value.code == 2
    assert msg in capsys.readouterr().err


def test_cli_rejects_bad_model_and_perf_files(tmp_path, capsys):
    assert main(["plan", "--model", str(tmp_path / "nope")]) == 2
    assert "not a model directory" in capsys.readouterr().err
    (tmp_path / "config.json").write_text("{}")
    bad = tmp_path / "bad.json"
    for text in ("not json", '{"num_layers": 2}', '{"num_layers": -1, "s_layer": {}, "s_head": {}}'):
        bad.write_text(text)
        assert main(["plan", "--model", str(tmp_path), "--perf", str(bad), "--out", str(tmp_path / "o.json")]) == 2
        assert "cannot read perf model" in capsys.readouterr().err
    assert not (tmp_path / "o.json").exists()
    pm = linear_model()
    pm.save(tmp_path / "ok.json")
    assert main(["plan", "--model", str(tmp_path), "--perf", str(tmp_path / "ok.json"), "--latency-budget", "0.001",
                 "--out", str(tmp_path / "o.json")]) == 2
    assert "below what batch 1 needs" in capsys.readouterr().err


@pytest.mark.parametrize("kwargs", [dict(seq_len=0), dict(seq_len=2.5), dict(max_batch=0), dict(f=-1),
                                    dict(num_minibatches=3), dict(latency_budget_s=float("inf")),
                                    dict(latency_budget_s=-1.0)])
def test_plan_rejects_garbage(kwargs):
    args = dict(seq_len=1024) | kwargs
    with pytest.raises(ValueError):
        plan(linear_model(), **args)


def test_perf_model_rejects_garbage():
    c = Curve.of({1: 1.0})
    for bad in (dict(num_layers=0), dict(r_per_token=0.0), dict(r_per_token=float("nan")), dict(r_fixed=-1.0)):
        kw = dict(num_layers=2, s_layer=c, s_head=c, r_per_token=1e-8) | bad
        with pytest.raises(ValueError):
            PerfModel(**kw)


def test_tiny_real_measurement(tiny_model_dir):
    """The micro-benchmarks run on the engine's model code and the kernel (values not asserted
    beyond being positive and well-formed: this machine is shared and noisy)."""
    t_pts, h_pts, shape = measure_s_part(tiny_model_dir, (1, 8), repeats=2)
    assert set(t_pts) == {1, 8}
    assert all(med >= low > 0 for med, low in (*t_pts.values(), *h_pts.values()))
    assert shape["hidden_size"] == 64 and shape["num_kv_heads"] == 2
    r_pts, backend = measure_r_part(2, 4, 16, contexts=(512, 8192), num_seqs=8, threads=1, repeats=2)
    assert set(r_pts) == {512, 8192} and all(med >= low > 0 for med, low in r_pts.values())
    assert backend == "kernels.KVStore(fp16, threads=1)"        # the kernel, never the torch fallback


def test_floor_model_roundtrip():
    pm = linear_model()
    fast = linear_model(a=A / 2, r=2.5e-8)
    with_floor = PerfModel(pm.num_layers, pm.s_layer, pm.s_head, pm.r_per_token, pm.r_fixed,
                           {**pm.meta, "floor": {k: v for k, v in fast.to_dict().items() if k not in ("num_layers", "meta")}})
    f = floor_model(PerfModel.from_dict(with_floor.to_dict()))
    assert f.T(64) == pytest.approx(A / 2 + B_SLOPE * 64) and f.r_per_token == 2.5e-8
    with pytest.raises(ValueError, match="no floor"):
        floor_model(pm)
