"""bench/gpu_check.py without a GPU: the message and exit 0, argument errors, a failing part
recorded while the others run, and the whole pipeline on the CPU (--cpu-smoke)."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import gpu_check  # noqa: E402
from gpu_parts import Context  # noqa: E402


@pytest.fixture
def keep_torch_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_without_a_gpu_it_says_so_and_exits_zero(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "gpu.json"
    assert gpu_check.main(["--out", str(out)]) == 0
    assert "no CUDA GPU" in capsys.readouterr().out
    assert not out.exists()


@pytest.mark.parametrize("argv, message", [
    (["--budget-s", "-1"], "--budget-s: must be a finite number > 0"),
    (["--budget-s", "soon"], "--budget-s: not a number"),
    (["--parts", "s_part,nope"], "unknown part(s) ['nope']"),
    (["--set", "nosuch=1"], "expected KEY=VALUE"),
    (["--set", "t_batches=a,b"], "not a valid tuple"),
    (["--set", "e2e_default=1,2"], "need 4 integers"),
    (["--set", "budget_hf=-5"], "must be >= 0"),
    (["--set", "seven_b_shape=[1]"], "need a JSON object"),
])
def test_bad_arguments_are_a_clear_error(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        gpu_check.main(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_set_overrides_profile_fields():
    p = gpu_check.apply_overrides(gpu_check.Profile(), ["tput_batches=8,2", "budget_hf=90", "dtype=float16",
                                                        "e2e_default=64,8,32,4"])
    assert p.tput_batches == (8, 2) and p.budget_hf == 90.0 and p.dtype == "float16"
    assert p.e2e_default == (64, 8, 32, 4)


def fake_part(name: str, ran: list):
    def part(ctx, budget):
        ran.append(name)
        return {"value": 1.0}
    return part


def boom(ctx, budget):
    raise ValueError("kaput")


def test_a_part_that_raises_is_recorded_and_the_others_run(tmp_path):
    ran: list[str] = []
    run = gpu_check.Run(tmp_path / "gpu.json", {"bench": "test"})
    ctx = Context(profile=gpu_check.cpu_smoke_profile(), work_dir=tmp_path)
    parts = {"first": fake_part("first", ran), "broken": boom, "last": fake_part("last", ran)}
    gpu_check.run_parts(run, parts, ctx, {}, time.monotonic() + 60)
    data = json.loads((tmp_path / "gpu.json").read_text())
    assert ran == ["first", "last"]
    assert data["parts"]["broken"]["status"] == "error"
    assert data["parts"]["broken"]["error"] == "ValueError: kaput"
    assert data["parts"]["last"] == {"status": "ok", "result": {"value": 1.0}, "seconds": pytest.approx(0, abs=1)}
    assert data["parts_failed"] == ["broken"]
    assert all(k in data for k in gpu_check.SUMMARY_KEYS)
    assert {k: b["pass"] for k, b in data["bars"].items()} == dict.fromkeys(gpu_check.BARS)


def test_parts_past_the_global_budget_are_skipped_and_recorded(tmp_path):
    ran: list[str] = []
    run = gpu_check.Run(tmp_path / "gpu.json", {})
    ctx = Context(profile=gpu_check.cpu_smoke_profile(), work_dir=tmp_path)
    gpu_check.run_parts(run, {"late": fake_part("late", ran)}, ctx, {}, time.monotonic() - 1)
    data = json.loads((tmp_path / "gpu.json").read_text())
    assert ran == [] and data["parts"]["late"]["status"] == "skipped"
    assert data["parts_failed"] == ["late"]


def test_main_records_a_failing_part_and_runs_the_next(monkeypatch, tmp_path, capsys, keep_torch_threads):
    monkeypatch.setitem(gpu_check.PARTS, "s_part", boom)
    out = tmp_path / "gpu.json"
    assert gpu_check.main(["--cpu-smoke", "--parts", "r_part,s_part", "--out", str(out)]) == 1
    data = json.loads(out.read_text())
    assert data["parts"]["s_part"]["error"] == "ValueError: kaput"
    assert data["parts"]["r_part"]["status"] == "ok"
    assert data["parts"]["r_part"]["result"]["default"]["call_ms_by_context"]
    assert list(data["parts"]) == ["s_part", "r_part"]        # the run's order, not the argument's
    assert "FAIL" not in capsys.readouterr().out.split("SLS figures")[0]   # no figures: n/a, not fail


def test_cpu_smoke_runs_every_part_and_writes_every_key(tmp_path):
    out = tmp_path / "gpu.json"
    done = subprocess.run([sys.executable, "bench/gpu_check.py", "--cpu-smoke", "--out", str(out),
                           "--commit", "abc123"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    data = json.loads(out.read_text())
    assert all(k in data for k in gpu_check.MACHINE_KEYS + gpu_check.SUMMARY_KEYS)
    assert data["commit"] == "abc123" and data["profile"]["name"] == "cpu-smoke"
    assert {n: p["status"] for n, p in data["parts"].items()} == dict.fromkeys(gpu_check.PARTS, "ok")
    parts = {n: p["result"] for n, p in data["parts"].items()}
    assert set(parts["s_part"]["7b_shape"]["T_ms_per_layer"]) == {"1", "2", "4", "8"}
    for name in ("default", "7b_shape"):
        e2e = parts[f"e2e_{name}"]
        assert set(e2e["runs"]) == {"fcfs", "sls"}
        assert all(e2e["runs"][p]["step_split_ms"]["step_time"] > 0 for p in ("fcfs", "sls"))
        assert e2e["comm_share"] is not None and e2e["steady_max_step_latency_ratio"] is not None
    for key in ("sls_steady_max_step_latency_ratio", "sls_throughput_ratio", "comm_share", "speedup_vs_hf_gpu",
                "perfmodel_error_max"):
        assert isinstance(data[key], float), key
        assert data["bars"][key]["pass"] in (True, False)
    assert parts["hf"]["largest_batch_run"] == 8                   # doubling past ours up to the cap
    assert "speedup_vs_hf_gpu" in done.stdout and "wrote" in done.stdout


def test_a_part_that_overruns_the_budget_meets_the_watchdog(tmp_path):
    out = tmp_path / "gpu.json"
    driver = ("import sys, time; sys.path.insert(0, 'bench'); import gpu_check\n"
              "gpu_check.PARTS['r_part'] = lambda ctx, budget: time.sleep(60)\n"
              f"sys.exit(gpu_check.main(['--cpu-smoke', '--parts', 'r_part', '--budget-s', '6', '--grace-s', '1', "
              f"'--out', {str(out)!r}]))\n")
    t = time.monotonic()
    done = subprocess.run([sys.executable, "-c", driver], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 3, done.stderr[-2000:]
    assert time.monotonic() - t < 50
    data = json.loads(out.read_text())
    assert data["watchdog"].startswith("fired at the budget and its grace")
    assert data["parts"]["r_part"] == {"status": "error", "error": "watchdog: overran the time budget"}


@pytest.mark.parametrize("error, stopped, entry", [
    (RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
     "out of memory at B=8", {"oom": True}),
    (RuntimeError("CUDA error: invalid configuration argument"), "error at B=8: RuntimeError", None)])
def test_hf_keeps_the_batches_it_measured_when_a_larger_one_fails(monkeypatch, tmp_path, error, stopped, entry):
    import transformers

    from fastdecode.testing import make_tiny_llama
    from gpu_parts import Budget, hf_part

    real = transformers.AutoModelForCausalLM.from_pretrained

    def failing_at_8(*args, **kwargs):
        model = real(*args, **kwargs)
        generate = model.generate

        def gen(ids, **kw):
            if ids.shape[0] >= 8:
                raise error
            return generate(ids, **kw)
        model.generate = gen
        return model
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", failing_at_8)
    profile = gpu_check.cpu_smoke_profile()
    ctx = Context(profile=profile, work_dir=tmp_path)
    ctx.models["default"] = {"dir": str(make_tiny_llama(tmp_path / "m", **profile.tiny_default))}
    out = hf_part(ctx, Budget(120, time.monotonic() + 120))
    assert set(out["runs"]) == {"2", "4", "8"} and out["stopped"] == stopped
    assert all(out["runs"][b]["tokens_per_s"] > 0 for b in ("2", "4"))
    assert out["runs"]["8"] == entry if entry else "invalid configuration" in out["runs"]["8"]["error"]
    assert out["largest_batch_run"] == 4 and out["best_batch"] in (2, 4)
