"""The functional suite's `--parallel`: several runs at once on the same GPUs, each resume only after
the run whose checkpoint it loads, and the same checks as one run at a time."""

import json
import os
import sys
import threading
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "functional"))
sys.path.insert(0, os.path.join(HERE, "..", "..", "scripts"))

import run_functional  # noqa: E402

CASES = ["baseline", "offload", "offload_chunked", "resume_offload", "resume_plain", "plain_to_offload", "crash",
         "resume_after_crash"]


class Recorder:
    """A fake `start`: each case sleeps a little and records when it ran and how many ran beside it."""

    def __init__(self, fail=()):
        self.lock = threading.Lock()
        self.running = 0
        self.most = 0
        self.spans = {}
        self.fail = set(fail)

    def __call__(self, name):
        with self.lock:
            self.running += 1
            self.most = max(self.most, self.running)
            begin = time.monotonic()
        time.sleep(0.2)
        with self.lock:
            self.running -= 1
            self.spans[name] = (begin, time.monotonic())
        if name in self.fail:
            raise RuntimeError(f"{name} failed")
        return f"record of {name}"


def test_runs_overlap_up_to_the_limit_and_each_resume_waits_for_its_source():
    rec = Recorder()
    out = run_functional.run_cases(CASES, rec, run_functional.LOADS_FROM, parallel=3)
    assert out == {name: f"record of {name}" for name in CASES}
    assert rec.most == 3  # (one at a time would be 1; more than the limit, 4 or more)
    for name, source in run_functional.LOADS_FROM.items():
        if name in CASES:
            assert rec.spans[name][0] >= rec.spans[source][1], f"{name} began before {source} ended"


def test_one_at_a_time_keeps_the_case_order():
    rec = Recorder()
    run_functional.run_cases(CASES, rec, run_functional.LOADS_FROM, parallel=1)
    assert rec.most == 1
    assert sorted(CASES, key=lambda n: rec.spans[n][0]) == CASES


def test_a_failed_source_skips_its_resumes_and_is_raised_after_the_others_end():
    rec = Recorder(fail={"offload"})
    with pytest.raises(RuntimeError, match="offload failed"):
        run_functional.run_cases(CASES, rec, run_functional.LOADS_FROM, parallel=4)
    assert "resume_offload" not in rec.spans and "resume_plain" not in rec.spans
    # Every case that does not load the failed run's checkpoint ran to its end.
    assert {"baseline", "offload_chunked", "plain_to_offload", "crash", "resume_after_crash"} <= set(rec.spans)


@pytest.fixture
def fake_runs(monkeypatch, tmp_path):
    """`launch` / `launch_expecting_failure` answered from a real run's records (each written to the
    folder as a run would leave it), with a short sleep so that parallel runs overlap."""
    data = json.load(open(os.path.join(HERE, "data", "functional_records_h100x1.json")))["runs"]
    busy = Recorder()  # (how many fake runs overlapped)

    def needs_source(name, out):
        # What the real runs need: the checkpoint of the run a case loads is complete (its run ended).
        source = run_functional.LOADS_FROM.get(name)
        assert source is None or os.path.exists(os.path.join(out, f"{source}.exit")), f"{name} before {source}"

    def finished(name, out, code):
        with open(os.path.join(out, f"{name}.exit"), "w") as f:
            f.write(str(code))

    def launch(name, args, nproc, out, script=None, env_extra=None):
        needs_source(name, out)
        busy(name)
        finished(name, out, 0)
        case = data[name]
        with open(os.path.join(out, f"{name}.log"), "w") as f:
            f.write("".join(f" [2026-11-26] iteration {int(i):8d}/      30 | consumed samples: {i} | lm loss: {v} |\n"
                            for i, v in case["printed"].items()))
        return {"name": name, "ranks": case["ranks"], "seconds": 0.05, "host": None}

    def launch_expecting_failure(name, args, nproc, out, script=None, timeout=None, env_extra=None):
        needs_source(name, out)
        busy(name)
        os.makedirs(os.path.join(out, "ckpt_crash", "iter_0000015"))
        finished(name, out, 1)
        return 1, "killing rank 0 (pid 1)\n", 0.05

    monkeypatch.setattr(run_functional, "launch", launch)
    monkeypatch.setattr(run_functional, "launch_expecting_failure", launch_expecting_failure)
    return busy


def test_the_suite_checks_the_same_with_runs_in_parallel(fake_runs, tmp_path):
    checks = {}
    for parallel in (1, 3):
        out = tmp_path / f"parallel{parallel}"
        out.mkdir()
        argv = ["--out", str(out), "--nproc", "1", "--script", "mock", "--cases", ",".join(CASES),
                "--parallel", str(parallel)]
        fake_runs.most = 0
        assert run_functional.main(argv) == 0
        assert fake_runs.most == parallel
        checks[parallel] = json.load(open(out / "functional_summary.json"))["checks"]
    assert len(checks[1]) >= 25 and all(ok for _, ok, _ in checks[1])
    # The same checks with the same outcomes, in the same order, whatever ran beside what.
    assert checks[3] == checks[1]
