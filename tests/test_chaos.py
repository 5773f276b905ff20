"""`make chaos` in short: bench/chaos.py's own code on a tiny model, 16 streaming clients, two faults
(SIGKILL + restart of an R-worker, malformed messages to live R-workers). One R-worker stays up
in both, so no request may be lost or fail, and every output must equal the fault-free run's."""
from __future__ import annotations

import sys

import pytest

from fastdecode.config import REPO_ROOT
from fastdecode.ops.triton import tritonserver_binary
from fastdecode.ops.testing import store_kind

sys.path.insert(0, str(REPO_ROOT / "bench"))
import chaos  # noqa: E402

pytestmark = [pytest.mark.triton,
              pytest.mark.skipif(not tritonserver_binary().exists(),
                                 reason=f"tritonserver binary missing ({tritonserver_binary()})")]

CLIENTS = 16


@pytest.fixture(scope="module")
def report(tiny_model_dir, tmp_path_factory):
    settings = chaos.Settings(model=tiny_model_dir, clients=CLIENTS, max_tokens=16, kv_capacity="64M",
                              rworker_args=("--store", store_kind(), "--drain-timeout", "5"),
                              deadline_s=60.0, malformed_rounds=2)
    return chaos.run(settings, ["kill", "malformed"], tmp_path_factory.mktemp("chaos"), log=lambda m: None)


def assert_clean(r: dict) -> None:
    assert not r["skipped"] and "failure" not in r, r.get("failure")
    assert r["lost"] == 0 and r["errors"] == 0, r
    assert r["completed_incorrect"] == 0, r["incorrect_samples"]
    assert r["accepted"] == r["completed_correct"] > CLIENTS      # the load went on through and after the fault
    assert r["every_client_completed_after_fault"], r


def test_fault_free_run_completes_every_prompt(report):
    assert report["fault_free"]["completed"] == CLIENTS, report["fault_free"]


def test_rworker_killed_mid_generation_and_restarted(report):
    r = report["scenarios"]["kill"]
    assert_clean(r)
    assert r["sequences_on_worker_at_fault"] > 0 and r["requests_streaming_at_fault"] >= CLIENTS // 2
    # the engine saw the worker go and rebuilt its sequences elsewhere; every output is still exact
    assert any(f"lost with R-worker {r['worker']}" in line for line in r["engine_events"]), r["engine_events"]
    assert r["restarted_worker_used_again"]


def test_malformed_messages_are_refused_and_the_load_is_unharmed(report):
    r = report["scenarios"]["malformed"]
    assert_clean(r)
    assert len(r["rounds"]) == 2 and {x["worker"] for x in r["rounds"]} == {0, 1}
    must_fail = sum(refuse for _, _, refuse in chaos.malformed_calls(chaos.model_kv_shape(report["config"]["model"]),
                                                                     chaos.random.Random(0)))
    assert must_fail >= 20
    for x in r["rounds"]:
        assert not x["unanswered"], x
        assert not x["accepted_unexpectedly"] and not x["refused_unexpectedly"], x
        assert x["refused"] >= must_fail, x
        assert x["stream_errors"]["oversized message"].startswith("RESOURCE_EXHAUSTED"), x
        assert x["serving_after"], x


def test_report_passes(report):
    assert report["ok"] and report["failures"] == [], report["failures"]
    assert set(report["scenarios"]) == {"kill", "malformed"}
