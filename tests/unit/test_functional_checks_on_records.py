"""The functional suite's comparisons (run_functional.compare_runs) on the records of a real run:
they pass as recorded, and each deliberately broken variant of the run makes its check fail."""

import copy
import json
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "functional"))
sys.path.insert(0, os.path.join(HERE, "..", "..", "scripts"))

from run_functional import compare_runs  # noqa: E402

ITERS, NPROC = 30, 1


@pytest.fixture
def recorded():
    data = json.load(open(os.path.join(HERE, "data", "functional_records_h100x1.json")))["runs"]
    runs = {name: {"ranks": case["ranks"]} for name, case in data.items()}
    printed = {name: {int(i): v for i, v in case["printed"].items()} for name, case in data.items()}
    return runs, printed


def failed(runs, printed):
    return [what for what, ok, _ in compare_runs(runs, printed, ITERS, NPROC) if not ok]


def test_the_recorded_run_passes_every_check(recorded):
    checks = compare_runs(*recorded, ITERS, NPROC)
    assert len(checks) >= 25
    assert [c for c in checks if not c[1]] == []


def test_a_save_that_brings_the_whole_state_back_fails(recorded):
    runs, printed = recorded
    rank = runs["offload_chunked"]["ranks"][0]
    for save in rank["saves"]:
        save["max_allocated"] = save["allocated_before"] + rank["offloaded_bytes"]
    assert failed(runs, printed) == ["offload_chunked: rank 0 checkpoint save reads what is off the GPU from the host"]


def test_a_save_with_the_state_resident_proves_nothing_and_fails(recorded):
    runs, printed = recorded
    for save in runs["offload_chunked"]["ranks"][0]["saves"]:
        save["offloaded_before"] = 0
    assert failed(runs, printed) == ["offload_chunked: rank 0 checkpoint save reads what is off the GPU from the host"]


def test_a_run_with_the_flag_that_never_attached_fails(recorded):
    """What an unattached plugin records: the baseline's memory and no bytes moved."""
    runs, printed = recorded
    rank = runs["offload"]["ranks"][0]
    rank.update(offloaded_bytes=0, cumulative_d2h_bytes=0,
                iterations=copy.deepcopy(runs["baseline"]["ranks"][0]["iterations"]))
    assert failed(runs, printed) == ["offload: rank 0 state actually moved", "offload: rank 0 steady peak reserved lower"]


def test_a_saving_inside_the_run_to_run_spread_fails(recorded):
    """0.05 GiB lower: a plain `<` passed on that; half the state is required."""
    runs, printed = recorded
    plain = runs["baseline"]["ranks"][0]["iterations"]
    for ours, base in zip(runs["offload"]["ranks"][0]["iterations"], plain):
        ours["max_reserved"] = base["max_reserved"] - 50 * 2**20
    assert failed(runs, printed) == ["offload: rank 0 steady peak reserved lower"]


def test_one_different_loss_fails(recorded):
    runs, printed = recorded
    its = runs["offload"]["ranks"][0]["iterations"]
    its[5]["loss"] = (float.fromhex(its[5]["loss"]) * (1 + 2**-20)).hex()  # before the resumes' save
    assert failed(runs, printed) == ["offload: losses bit-identical at every iteration"]


def test_a_run_that_stopped_early_fails_although_its_losses_match(recorded):
    runs, printed = recorded
    del runs["offload"]["ranks"][0]["iterations"][25:]
    assert "offload: losses bit-identical at every iteration" in failed(runs, printed)


def test_a_load_that_puts_the_state_on_the_gpu_fails(recorded):
    runs, printed = recorded
    rank = runs["resume_offload"]["ranks"][0]
    rank["startup_peak"]["max_allocated"] += rank["offloaded_bytes"]
    assert failed(runs, printed) == ["resume_offload: rank 0 the load brought no optimizer state to the GPU"]


def test_different_final_params_or_state_fail(recorded):
    runs, printed = recorded
    runs["offload"]["ranks"][0]["params_sha256"] = "0" * 64
    runs["offload_chunked"]["ranks"][0]["optimizer_state_sha256"] = "0" * 64
    got = failed(runs, printed)
    assert "offload: rank 0 final params identical" in got
    assert "offload_chunked: rank 0 final optimizer state identical" in got
    # The resumes from the offload run are compared with its final params too.
    assert set(got) - {"offload: rank 0 final params identical", "offload_chunked: rank 0 final optimizer state identical"} == {
        f"{n}: rank 0 final params identical" for n in ("resume_offload", "resume_plain", "resume_after_crash")}


def test_a_resumed_printed_loss_off_the_logging_rule_fails(recorded):
    runs, printed = recorded
    printed["resume_offload"][25] = "1.000000E+00"
    assert failed(runs, printed) == ["resume_offload: printed losses identical to the uninterrupted run"]


def with_model_only_pair(runs, printed):
    """A model-only pair shaped like the resumes (both runs resume the same checkpoint, one with
    offloading), which the recorded run predates."""
    for pair, source in (("model_only_plain", "resume_plain"), ("model_only_offload", "resume_offload")):
        runs[pair] = copy.deepcopy(runs[source])
        printed[pair] = dict(printed[source])
    return runs, printed


def test_a_model_only_pair_passes_and_each_broken_part_fails(recorded):
    runs, printed = with_model_only_pair(*recorded)
    checks = [what for what, _, _ in compare_runs(runs, printed, ITERS, NPROC) if what.startswith("model_only")]
    assert len(checks) == 5 and failed(runs, printed) == []
    its = runs["model_only_offload"]["ranks"][0]["iterations"]
    its[3]["loss"] = (float.fromhex(its[3]["loss"]) * (1 + 2**-20)).hex()
    runs["model_only_offload"]["ranks"][0]["startup_peak"]["max_allocated"] += runs["offload"]["ranks"][0]["offloaded_bytes"]
    assert failed(runs, printed) == ["model_only_offload: losses identical to the same model-only load without offloading",
                                     "model_only_offload: rank 0 the load brought no optimizer state to the GPU"]


def test_from_records_checks_the_runs_that_finished(tmp_path, capsys):
    """`run_functional.py --from-records` (a suite cut short by a time limit): the recorded runs are
    checked as if just run, a run that never finished is left out and named, one that failed is a
    failure; nothing is launched."""
    import run_functional

    data = json.load(open(os.path.join(HERE, "data", "functional_records_h100x1.json")))["runs"]
    for name, case in data.items():
        if name == "resume_plain":  # cut by the time limit: a log, no exit code
            (tmp_path / f"{name}.log").write_text("")
            continue
        os.makedirs(tmp_path / name)
        for r, rank in enumerate(case["ranks"]):
            (tmp_path / name / f"rank{r}.json").write_text(json.dumps(rank))
        (tmp_path / f"{name}.exit").write_text("0")
        (tmp_path / f"{name}.log").write_text("".join(
            f" [2026-11-26] iteration {int(i):8d}/      30 | consumed samples: {i} | lm loss: {v} |\n"
            for i, v in case["printed"].items()))
    cases = ",".join(data)
    argv = ["--out", str(tmp_path), "--nproc", str(NPROC), "--script", "mock", "--from-records", "--cases", cases]
    assert run_functional.main(argv) == 1  # (the unfinished run fails)
    out = capsys.readouterr().out
    assert "no finished run of ['resume_plain']" in out
    summary = json.load(open(tmp_path / "functional_summary.json"))
    assert summary["from_records"] and len(summary["checks"]) >= 25
    assert [what for what, ok, _ in summary["checks"] if not ok] == ["resume_plain: finished"]
    assert "resume_plain" not in summary["cases"] and "plain_to_offload" in summary["cases"]
    # A record that cannot be read is a failure, not a crash of the re-check.
    (tmp_path / "resume_offload" / "rank0.json").write_text("{")
    assert run_functional.main(argv) == 1
    failed = [what for what, ok, _ in json.load(open(tmp_path / "functional_summary.json"))["checks"] if not ok]
    assert failed == ["resume_plain: finished", "resume_offload: records readable"]
    (tmp_path / "resume_offload" / "rank0.json").write_text(json.dumps(data["resume_offload"]["ranks"][0]))
    # A run that exited non-zero fails; a broken record fails its comparison.
    (tmp_path / "offload_chunked.exit").write_text("1")
    rank = json.loads((tmp_path / "offload" / "rank0.json").read_text())
    rank["params_sha256"] = "0" * 64
    (tmp_path / "offload" / "rank0.json").write_text(json.dumps(rank))
    assert run_functional.main(argv) == 1
    failed = [what for what, ok, _ in json.load(open(tmp_path / "functional_summary.json"))["checks"] if not ok]
    assert "offload_chunked: finished" in failed
    assert "offload: rank 0 final params identical" in failed


def test_a_new_call_removes_what_an_earlier_one_left(tmp_path):
    """Exit codes and a summary of an earlier call in the same folder must not pass for this call's
    (--from-records reads them): a run cut short leaves none, and the runner removes the old ones
    before it launches anything."""
    import megatron_runs
    import run_functional

    for name in ("baseline", "offload"):
        (tmp_path / f"{name}.exit").write_text("0")
    (tmp_path / "functional_summary.json").write_text("{}")

    def cut_short(name, *a, **k):
        assert not (tmp_path / f"{name}.exit").exists() and not (tmp_path / "functional_summary.json").exists()
        raise KeyboardInterrupt  # (what the suite's time limit does to the runner)

    run_functional.launch, saved = cut_short, run_functional.launch
    try:
        with pytest.raises(KeyboardInterrupt):
            run_functional.main(["--out", str(tmp_path), "--nproc", "1", "--script", "mock", "--cases", "baseline,offload"])
    finally:
        run_functional.launch = saved
    assert not (tmp_path / "offload.exit").exists()
    # megatron_runs._run removes a run's own old exit code before it starts it.
    (tmp_path / "x.exit").write_text("0")
    with pytest.raises(FileNotFoundError):
        megatron_runs._run("x", ["/nonexistent-binary"], {}, str(tmp_path), 5)
    assert not (tmp_path / "x.exit").exists()


def test_resume_baseline_is_checked_against_the_baseline(recorded):
    """Megatron's own resume (no plugin on either side) is compared with the baseline, so that a
    resume differing with the plugin can be told from one differing without it."""
    runs, printed = recorded
    runs["resume_baseline"] = copy.deepcopy(runs["plain_to_offload"])
    printed["resume_baseline"] = dict(printed["plain_to_offload"])
    checks = [what for what, _, _ in compare_runs(runs, printed, ITERS, NPROC) if what.startswith("resume_baseline")]
    assert len(checks) == 2 + NPROC and failed(runs, printed) == []
    same_as_megatron = [what for what, _, _ in compare_runs(runs, printed, ITERS, NPROC) if "(resume_baseline)" in what]
    assert len(same_as_megatron) == 4  # resume_offload, resume_plain, plain_to_offload, resume_after_crash
    # Params alone differing from Megatron's own resume fail the same checks (and its own params check).
    params_kept = runs["resume_baseline"]["ranks"][0]["params_sha256"]
    runs["resume_baseline"]["ranks"][0]["params_sha256"] = "0" * 64
    assert sorted(failed(runs, printed)) == sorted(["resume_baseline: rank 0 final params identical",
                                                    *same_as_megatron])
    runs["resume_baseline"]["ranks"][0]["params_sha256"] = params_kept
    its = runs["resume_baseline"]["ranks"][0]["iterations"]
    its[-1]["loss"] = (float.fromhex(its[-1]["loss"]) * (1 + 2**-20)).hex()
    assert sorted(failed(runs, printed)) == sorted(["resume_baseline: resumed losses identical to the uninterrupted run",
                                                    *same_as_megatron])
