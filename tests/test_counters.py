"""medddpm.counters: Nsight Compute counters added to a measured run, with a stand-in ncu that replays
real H200 output (no GPU or ncu needed)."""

import gzip
import json
import re
import shutil
from pathlib import Path

import pandas as pd
import pytest

from medddpm.analysis import ncu_table
from medddpm.measure.profile import ncu

from medddpm.store import schema
from medddpm.cli.main import main
from medddpm.measure.profile.counters import CountersError, add_counters, check_run

FIX = Path(__file__).parent / "fixtures"
DETAILS = FIX / "h200/ncu-opt1-size32-details.csv.gz"
REAL = Path(__file__).parent.parent / "data" / "cpu" / "opt1"


@pytest.fixture
def run_dir(tmp_path) -> Path:
    """data/cpu/opt1 with a step made of the fixture's first four kernels: 45, 36, 10 and 9% of it."""
    if not (REAL / "run.parquet").is_file():
        pytest.skip("no data/cpu/opt1 run")
    dest = tmp_path / "cpu" / "opt1"
    shutil.copytree(REAL, dest)
    (dest / "ncu.parquet").unlink(missing_ok=True)
    names = ncu_table.parse_details_csv(DETAILS).groupby("kernel_id")["kernel"].first().unique().tolist()
    k = schema.read_table(dest / "kernels.parquet", "kernels").iloc[:1]
    rows = [k.assign(kernel=n, total_us=t, calls=1, category="convolution") for n, t in
            zip(names[:4], (45.0, 36.0, 10.0, 9.0))]
    kernels = pd.concat(rows, ignore_index=True)
    schema.write_table(kernels.assign(share=kernels["total_us"] / kernels["total_us"].sum()),
                       dest / "kernels.parquet", "kernels")
    return dest


def fake_ncu(bin_dir: Path, details: Path) -> None:
    """An `ncu` that writes the report it is asked for and exports `details` as its CSV."""
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "ncu"
    fake.write_text("#!/bin/sh\ncase \"$1\" in --query-metrics) exit 1;; -i) gzip -dc " + str(details) + "; exit 0;; esac\n"
                    "for a; do [ \"$prev\" = -o ] && touch \"$a\"; prev=$a; done\nexit 0\n")
    fake.chmod(0o755)


@pytest.fixture
def stand_in(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:/usr/bin:/bin")
    monkeypatch.setattr(ncu, "_cuda_available", lambda: True)
    monkeypatch.setattr("medddpm.measure.profile.counters.NCU_REPORTS", tmp_path / "reports")
    monkeypatch.setenv("MEDDDPM_GIT_COMMIT", "c0ffee")
    return lambda details: fake_ncu(tmp_path / "bin", details)


def only_kernels(tmp_path: Path, keep: int, *, first: int = 0) -> Path:
    """The fixture's CSV with only the launches of `keep` of its kernel names, from the `first`."""
    df = ncu_table.parse_details_csv(DETAILS)
    names = df.groupby("kernel_id")["kernel"].first().unique()[first:first + keep]
    lines = gzip.open(DETAILS, "rt").read().splitlines(keepends=True)
    out = tmp_path / f"details-{first}-{keep}.csv.gz"
    with gzip.open(out, "wt") as f:
        f.writelines(line for i, line in enumerate(lines) if i == 0 or any(f'"{n}"' in line for n in names))
    return out


def test_counters_replace_a_run_s_only_when_they_cover_more(run_dir, stand_in, tmp_path):
    run_id = schema.read_table(run_dir / "run.parquet", "run").loc[0, "run_id"]
    stand_in(only_kernels(tmp_path, 2))
    status = add_counters(run_dir, device="cpu", timeout_s=60)
    assert status["status"] == "ok" and status["profiled_coverage"] == pytest.approx(0.81), status
    assert status["selected_kernels"] == 3 and status["coverage"] == pytest.approx(0.91)  # 85% aimed at, not 80
    table = schema.read_table(run_dir / "ncu.parquet", "ncu")
    assert (table["run_id"] == run_id).all() and table["kernel"].nunique() == 2
    recorded = json.loads(schema.read_table(run_dir / "run.parquet", "run").loc[0, "profilers"])
    assert recorded["ncu"]["git_commit"] == "c0ffee" and recorded["ncu"]["profiled_coverage"] == pytest.approx(0.81)
    assert recorded["torch"]["status"] == "ok"  # the rest of the row is untouched

    stand_in(only_kernels(tmp_path, 1))  # covers less: the run keeps what it had
    status = add_counters(run_dir, device="cpu", timeout_s=60)
    assert status["kept"] == "the run's counters (covers 45.00%, the run's counters 81.00%)"  # 79.96% is not 80.0%
    assert schema.read_table(run_dir / "ncu.parquet")["kernel"].nunique() == 2
    status = add_counters(run_dir, device="cpu", timeout_s=60, force=True)
    assert "new counters" in status["kept"] and schema.read_table(run_dir / "ncu.parquet")["kernel"].nunique() == 1

    stand_in(DETAILS)  # every kernel: more than before
    add_counters(run_dir, device="cpu", timeout_s=60)
    assert schema.read_table(run_dir / "ncu.parquet")["kernel"].nunique() > 2


def test_counters_merge_adds_a_pass_to_the_run_s(run_dir, stand_in, tmp_path):
    stand_in(only_kernels(tmp_path, 1))  # 45% of the step
    add_counters(run_dir, device="cpu", timeout_s=60)
    before = schema.read_table(run_dir / "ncu.parquet", "ncu")
    stand_in(only_kernels(tmp_path, 1, first=1))  # another 36%: alone, it covers less and is not kept
    assert add_counters(run_dir, device="cpu", timeout_s=60)["kept"].startswith("the run's counters (covers 36.00%")
    status = add_counters(run_dir, device="cpu", timeout_s=60, merge=True)
    assert status["profiled_coverage"] == pytest.approx(0.81), status
    assert status["message"].endswith(f"added to the run's {before['kernel_id'].nunique()} launches")
    table = schema.read_table(run_dir / "ncu.parquet", "ncu")
    assert table["kernel"].nunique() == 2 and table.groupby("kernel_id")["kernel"].nunique().eq(1).all()
    assert table["kernel_id"].nunique() > before["kernel_id"].nunique()
    assert table[table["kernel_id"].isin(before["kernel_id"])].reset_index(drop=True).equals(before)
    recorded = json.loads(schema.read_table(run_dir / "run.parquet", "run").loc[0, "profilers"])["ncu"]
    assert recorded["profiled_coverage"] == pytest.approx(0.81)
    assert recorded["merged"]["profiled_coverage"] == pytest.approx(0.45)  # the counters it was added to


def test_a_merge_profiles_only_what_the_run_s_counters_lack(run_dir, stand_in, tmp_path, monkeypatch):
    # Each merge's own pass leaves out the kernels already covered, and its library pass skips the launches
    # the library passes before it profiled (library passes that predate `first_launch` started at launch 0).
    calls = []
    real = ncu._profile
    monkeypatch.setattr(ncu, "_profile", lambda cmd, *a, **k: (calls.append(cmd), real(cmd, *a, **k))[1])
    names = schema.read_table(run_dir / "kernels.parquet", "kernels")["kernel"].tolist()
    stand_in(only_kernels(tmp_path, 1))  # covers the first kernel alone
    add_counters(run_dir, device="cpu", timeout_s=60, passes=("own",))
    own = re.compile(calls[-1][calls[-1].index("--kernel-name") + 1].removeprefix("regex:"))
    assert all(own.search(n) for n in names[:3])  # 85% of the step: the first three kernels
    status = add_counters(run_dir, device="cpu", timeout_s=60, passes=("own",), merge=True)
    own = re.compile(calls[-1][calls[-1].index("--kernel-name") + 1].removeprefix("regex:"))
    assert not own.search(names[0]) and all(own.search(n) for n in names[1:3])
    assert status["passes"]["own"]["kernels"] == 2

    row = schema.read_table(run_dir / "run.parquet", "run")
    recorded = json.loads(row.loc[0, "profilers"])
    recorded["ncu"]["merged"]["passes"] = {"library": {"launches": 97}}  # a library pass without `first_launch`
    row.loc[0, "profilers"] = json.dumps(recorded)
    schema.write_table(row, run_dir / "run.parquet", "run")
    assert ncu.library_launches_done(recorded["ncu"]) == 97
    library = {"launches": 12, "first_launch": 97}
    assert ncu.library_launches_done({"passes": {"library": library}, "merged": recorded["ncu"]}) == 109
    # the stand-in's table covers the first kernel only: nothing is left for the own pass of this selection
    status = add_counters(run_dir, device="cpu", timeout_s=60, passes=("own",), merge=True, coverage=0.4)
    assert status["status"] == "skipped" and "no selected kernel left" in status["message"], status


def test_counters_refuse_what_they_cannot_count(run_dir, tmp_path):
    with pytest.raises(CountersError, match="no run.parquet here"):
        check_run(tmp_path / "nowhere", device="cpu")
    with pytest.raises(CountersError, match="measured on cpu, this machine has "):
        check_run(run_dir, device="cuda")
    run = schema.read_table(run_dir / "run.parquet", "run")
    schema.write_table(run.assign(precision="fp32"), run_dir / "run.parquet", "run")
    with pytest.raises(CountersError, match="the run does not match opt1.s switches \\(precision=fp32\\)"):
        check_run(run_dir, device="cpu")
    schema.write_table(run.assign(status="oom"), run_dir / "run.parquet", "run")
    with pytest.raises(CountersError, match="status is 'oom'"):
        check_run(run_dir, device="cpu")
    schema.write_table(run, run_dir / "run.parquet", "run")
    (run_dir / "kernels.parquet").unlink()
    with pytest.raises(CountersError, match="no kernels.parquet"):
        check_run(run_dir, device="cpu")


def test_device_script_stops_on_a_bad_folder(run_dir, tmp_path):
    import os
    import subprocess
    import sys

    script = Path(__file__).parent.parent / "lab" / "leases" / "tools" / "device-counters.sh"
    env = os.environ | {"OUT": str(tmp_path / "out"), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    proc = subprocess.run(["bash", str(script), "300", str(tmp_path / "nowhere"), str(run_dir)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "no run.parquet here" in proc.stderr + proc.stdout, proc.stderr
    assert not (tmp_path / "out" / "counters.tgz").exists()


def test_counters_command_checks_every_folder_first(run_dir, tmp_path, capsys):
    for runs, why in (([run_dir, tmp_path / "nowhere"], "this machine has"), ([tmp_path / "nowhere"], "no run.parquet")):
        assert main(["counters", *map(str, runs)]) == 2  # one line, before any profiling
        assert why in capsys.readouterr().err and not (run_dir / "ncu.parquet").exists()


class Nvtx:
    """torch.cuda.nvtx as a recorder (the CPU build has no NVTX)."""

    def __init__(self):
        self.events = []

    def range_push(self, name):
        self.events.append(("push", name))

    def range_pop(self):
        self.events.append(("pop",))

    def range_start(self, name):
        self.events.append(("start", name))
        return 7

    def range_end(self, handle):
        self.events.append(("end", handle))


@pytest.mark.parametrize("from_backward", [None, "", "conv3d 32>32 k3 s2"])
def test_capture_names_every_convolution_forward_and_backward(monkeypatch, from_backward):
    """The profiled step's layer ranges: one around each Conv3d's forward and one around its backward,
    balanced on each thread; with --from-backward the step's range starts at the named layer's backward."""
    import torch

    from medddpm.measure.profile import capture

    from medddpm.train import engine

    nvtx = Nvtx()
    monkeypatch.setattr(torch.cuda, "nvtx", nvtx)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    init = engine.Engine.__init__
    monkeypatch.setattr(capture.Engine, "__init__", lambda self, spec, config, **kw: init(self, spec, config,
                                                                                           **kw | {"device": "cpu"}))
    args = ["--config", "baseline", "--preset", "smoke", "--warmup", "0"]
    capture.main(args + (["--from-backward", from_backward] if from_backward is not None else []))
    pushes = [e[1] for e in nvtx.events if e[0] == "push"]
    assert len(pushes) == 50 and sum(e[0] == "pop" for e in nvtx.events) == 50  # the smoke model's 25 convolutions
    assert pushes[0] == "conv3d 4>32 k3 s1 @16x16x16" and pushes[25] == "conv3d 32>1 k3 s1 @16x16x16 backward"
    assert sorted(p.removesuffix(" backward") for p in pushes[25:]) == sorted(pushes[:25])
    start = next(i for i, e in enumerate(nvtx.events) if e[0] == "start")
    after = nvtx.events[start + 1] if start + 1 < len(nvtx.events) else None
    if from_backward is None:
        assert start == 0
    else:
        assert after[0] == "push" and after[1].startswith(from_backward) and after[1].endswith("backward")
    assert nvtx.events[-1] == ("end", 7)
