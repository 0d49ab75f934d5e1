"""Faults of the sweep and the data tree: a killed producer, a crash at every step of publishing, two sweeps
into one folder, hostile strings in job scripts, a full disk, tables with wrong values. Each one ends in an
exit code, exactly one line naming the problem, and nothing lost (the tables compared before and after).

The producer notebook is replaced by a function that writes a run's tables into the staging folder as the
notebook does (`producer`), so the sweep's own steps run at full speed; one test kills a real kernel."""

import errno
import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import nbformat
import pandas as pd
import pytest
import torch

from medddpm.cli.main import main
from medddpm.configs import get_config
from medddpm.measure import sweep as sw
from medddpm.measure.env import environment
from medddpm.measure.run import run_row
from medddpm.report import loading
from medddpm.store import identity, layout, lock, schema, storage
from medddpm.store.schema import read_table, write_table

REPO = Path(__file__).resolve().parents[1]

ROOT = Path(__file__).resolve().parent.parent
_ids = itertools.count()


@pytest.fixture(scope="module")
def env():
    return environment(torch.device("cpu"))


def _tables(folder: Path) -> dict:
    """Every table of a run folder, for comparing before and after."""
    return {p.name: pd.read_parquet(p) for p in sorted(folder.glob("*.parquet"))}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].equals(b[k]) for k in a)


@pytest.fixture
def producer(monkeypatch, env):
    """Replace papermill's run of the producer notebook: `modes[config]` is 'ok' (every table, run.parquet
    last), 'die' (the kernel dies after its steps table, as the OOM killer leaves it) or 'fail' (an error
    the notebook records in run.parquet)."""
    import papermill

    modes: dict[str, str] = {}

    def execute(notebook, output, parameters, **kw):
        stage, config = Path(parameters["stage"]), get_config(parameters["config"])
        run_id = f"{parameters['gpu_label']}/{config.name}/{next(_ids)}"
        steps = pd.DataFrame({"run_id": run_id, "phase": "train", "micro_step": [0, 1], "timed": [False, True],
                              "step_ms": [3.0, 2.0], "dispatch_ms": [0.1, 0.1], "loss": [0.5, 0.4],
                              "peak_mem_bytes": -1})
        write_table(steps, stage / "steps.parquet", "steps")
        mode = modes.get(config.name, "ok")
        if mode == "die":
            from nbclient.exceptions import DeadKernelError

            raise DeadKernelError("Kernel died")
        status = "error" if mode == "fail" else "ok"
        row = run_row(config, parameters["preset"], env=env, gpu_name="cpu", label=parameters["gpu_label"],
                      status=status, message="train: RuntimeError: boom" if status == "error" else "")
        row |= {"run_id": run_id, "train_median_ms": 2.0, "timed_steps": 1}
        write_table(pd.DataFrame([row]), stage / "run.parquet", "run")
        Path(output).write_text("{}")

    monkeypatch.setattr(papermill, "execute_notebook", execute)
    return modes


def _sweep(tmp_path, configs="baseline", **kw):
    return sw.sweep(configs, preset="smoke", out=tmp_path / "data", device="cpu", gpu_label="cpu", **kw)


def _cli(capsys, *args) -> tuple[int, list[str]]:
    """The command line in this process: exit code and the lines of stderr that are not progress."""
    capsys.readouterr()
    try:
        rc = main(list(args))
    except SystemExit as e:
        rc = e.code
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return rc, [line for line in err.splitlines() if not line.startswith("[")]


# -------------------------------------------------------------------------------------- a killed producer

def test_a_dead_kernel_leaves_an_error_row_alone_and_keeps_a_finished_run(tmp_path, producer):
    data = tmp_path / "data" / "cpu"
    producer["opt1"] = "die"
    results = _sweep(tmp_path, "baseline,opt1")
    assert [r["status"] for r in results] == ["ok", "error"]
    assert sorted(p.name for p in (data / "opt1").glob("*.parquet")) == ["run.parquet"], "nothing stale beside"
    assert read_table(data / "opt1" / "run.parquet").loc[0, "message"].startswith("DeadKernelError")
    with warnings.catch_warnings():
        warnings.simplefilter("error", loading.DataWarning)
        assert sorted(loading.load("steps", tmp_path / "data")["config"].unique()) == ["baseline"]
    before = _tables(data / "baseline")
    producer["baseline"] = "die"
    results = _sweep(tmp_path, "baseline", force=True)
    assert results[0]["status"] == "error" and sw.failed(results)
    assert _same(_tables(data / "baseline"), before), "a finished run stays as it was"
    assert not list(data.glob(".*")), "no staging folder left"
    producer["opt1"] = "ok"
    assert [r["status"] for r in _sweep(tmp_path, "baseline,opt1")] == ["done before", "ok"], \
        "an error is measured again, a finished run is not"


def test_a_real_kernel_killed_mid_run_leaves_no_table_of_its_own(tmp_path, monkeypatch, capfd):
    notebook = tmp_path / "die.ipynb"
    nb = nbformat.v4.new_notebook(metadata={"kernelspec": {"name": "python3", "language": "python",
                                                           "display_name": "Python 3"},
                                            "language_info": {"name": "python"}})
    nb.cells = [nbformat.v4.new_code_cell('stage = ""\nconfig = ""', metadata={"tags": ["parameters"]}),
                nbformat.v4.new_code_cell(
                    "import os, signal, pandas as pd\nfrom medddpm.store.schema import write_table\n"
                    "write_table(pd.DataFrame({'run_id': 'x', 'phase': 'train', 'micro_step': [0], 'timed': [True], "
                    "'step_ms': [1.0], 'dispatch_ms': [0.1], 'loss': [0.5], 'peak_mem_bytes': -1}), "
                    "os.path.join(stage, 'steps.parquet'), 'steps')\n"
                    "os.write(2, b'native: out of device memory\\n')\nos.kill(os.getpid(), signal.SIGKILL)")]
    nbformat.write(nb, notebook)
    t0 = time.time()
    results = _sweep(tmp_path, notebook=notebook)
    folder = tmp_path / "data" / "cpu" / "baseline"
    assert results[0]["status"] == "error", results
    assert [p.name for p in folder.glob("*.parquet")] == ["run.parquet"]
    message = read_table(folder / "run.parquet").loc[0, "message"]
    assert "DeadKernelError" in message and message.endswith("the kernel last wrote: native: out of device memory")
    err = capfd.readouterr().err  # the kernel's own output stays out of the terminal; the error line quotes it
    assert err.count("native:") == err.count("the kernel last wrote: native:") == 1, err
    assert "native: out of device memory" in (folder / layout.KERNEL_LOG).read_text()
    assert time.time() - t0 < 120


# -------------------------------------------------------------------------------------- publishing


class Crash(BaseException):
    """A process dying at this instant: nothing after it runs (not even an except Exception)."""


def _two_results(tmp_path, env) -> tuple[Path, Path, dict, dict]:
    """A published run in data/cpu/baseline and a finished new one in its staging folder."""
    root = tmp_path / "data" / "cpu"
    folders = []
    for name in ("baseline", ".baseline.stage-4242"):
        row = run_row(get_config("baseline"), "smoke", env=env, gpu_name="cpu", label="cpu", status="ok", message="")
        row["run_id"] = f"cpu/baseline/{name}"
        write_table(pd.DataFrame([row]), root / name / "run.parquet", "run")
        folders.append(root / name)
    return root, *folders, _tables(folders[0]), _tables(folders[1])


@pytest.mark.parametrize("step", ["before the exchange", "after the exchange", "renaming the old away",
                                  "between the renames", "after the renames"])
def test_a_crash_at_any_step_of_publishing_leaves_the_old_or_the_new_result(tmp_path, env, monkeypatch, step):
    root, final, stage, old, new = _two_results(tmp_path, env)
    exchange, rename = storage._exchange, os.rename
    renames = itertools.count()

    def crash_exchange(a, b):
        if step == "after the exchange":
            assert exchange(a, b)
        raise Crash

    def crash_rename(a, b):
        k = next(renames)
        if (step, k) in (("renaming the old away", 0), ("between the renames", 1)):
            raise Crash
        rename(a, b)
        if (step, k) == ("after the renames", 1):
            raise Crash

    if step in ("before the exchange", "after the exchange"):
        monkeypatch.setattr(storage, "_exchange", crash_exchange)
    else:
        monkeypatch.setattr(storage, "_exchange", lambda a, b: False)  # a file system without renameat2
        monkeypatch.setattr(storage.os, "rename", crash_rename)
    with pytest.raises(Crash):
        storage.publish_folder(stage, final, root / ".baseline.old-4242")
    monkeypatch.undo()
    with lock.output_lock(final, lock_file=root / ".baseline.lock"):  # what the next sweep does first
        sw._clean(root, "baseline")
    assert _same(_tables(final), old) or _same(_tables(final), new), step
    assert sorted(p.name for p in root.iterdir()) == ["baseline"], "the leftovers are gone, whatever their pid"


def test_concurrent_publishers_never_leave_the_folder_missing(tmp_path):
    root = tmp_path / "cpu"
    code = ("import sys, pathlib, shutil\nfrom medddpm.store.storage import publish_folder\n"
            "root = pathlib.Path(sys.argv[1]); me = sys.argv[2]\n"
            "for i in range(150):\n"
            "    s = root / f'.f.stage-{me}-{i}'; s.mkdir(); (s / 'run.parquet').write_text(me)\n"
            "    publish_folder(s, root / 'f', root / f'.f.old-{me}-{i}')\n"
            "    shutil.rmtree(s, ignore_errors=True)\n"
            "    shutil.rmtree(root / f'.f.old-{me}-{i}', ignore_errors=True)\n")
    root.mkdir()
    envp = os.environ | {"PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, "-c", code, str(root), me], env=envp, stderr=subprocess.PIPE, text=True)
             for me in "ab"]
    seen_missing = 0
    while any(p.poll() is None for p in procs):
        if (root / "f").exists() or (root / "f").is_symlink():
            seen_missing += not (root / "f" / "run.parquet").is_file()
    errs = [p.communicate()[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], errs
    assert seen_missing == 0 and (root / "f" / "run.parquet").read_text() in "ab"


def test_a_sweep_removes_leftovers_of_any_pid_and_puts_back_a_result_a_crash_took_away(tmp_path, producer):
    _sweep(tmp_path)
    root = tmp_path / "data" / "cpu"
    before = _tables(root / "baseline")
    os.rename(root / "baseline", root / ".baseline.old-1")  # killed between the two renames, by pid 1
    (root / f".baseline.stage-{os.getpid()}").mkdir()  # a stage of this very pid (pids repeat in containers)
    (root / ".baseline.stage-vm-999999").mkdir()
    assert _sweep(tmp_path)[0]["status"] == "done before"
    assert _same(_tables(root / "baseline"), before)
    assert sorted(p.name for p in root.iterdir()) == ["baseline", "roofs.parquet"]  # the label's roofs beside


# -------------------------------------------------------------------------------------- the lock


def test_a_second_sweep_into_a_folder_in_use_fails_at_once_naming_the_first(tmp_path, capsys, producer):
    root = tmp_path / "data" / "cpu"
    _sweep(tmp_path)
    before = _tables(root / "baseline")
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\nfrom medddpm.store.lock import output_lock\n"
                               "with output_lock(sys.argv[1], 'sweep', lock_file=sys.argv[2]):\n"
                               "    print('held', flush=True); time.sleep(60)",
                               str(root / "baseline"), str(root / ".baseline.lock")],
                              env=os.environ | {"PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        t0 = time.time()
        rc, lines = _cli(capsys, "sweep", "--configs", "opt1,baseline", "--out", str(tmp_path / "data"),
                         "--device", "cpu", "--gpu-label", "cpu", "--force")
        assert time.time() - t0 < 10
        assert rc == 2 and len(lines) == 1, lines
        assert lines[0].startswith(f"error: {root / 'baseline'} is in use by sweep (pid {holder.pid} on host ")
        assert "since 20" in lines[0]
        assert not (root / "opt1").exists(), "nothing measured: the check comes before any work"
        # `counters` rewrites a run's tables: it takes the same lock, for a run of another identity too
        with pytest.raises(lock.FolderInUse, match=rf"in use by sweep \(pid {holder.pid} "):
            with sw.run_lock(root / "baseline~0123abcd", "counters"):
                pass
    finally:
        holder.kill()
        holder.wait()
    assert _same(_tables(root / "baseline"), before)
    assert [r["status"] for r in _sweep(tmp_path, "opt1,baseline")] == ["ok", "done before"], \
        "the lock of a killed holder does not block"
    assert not list(root.glob(".*"))


def test_the_lock_names_its_holder_is_reentrant_and_refuses_a_file(tmp_path):
    folder = tmp_path / "out"
    with lock.output_lock(folder, what="training"):
        with lock.output_lock(folder):  # the same process: re-entrant
            pass
        holder = lock.lock_holder(folder)
        assert holder["pid"] == str(os.getpid()) and holder["what"] == "training"
        p = subprocess.run([sys.executable, "-c", "import sys\nfrom medddpm.store.lock import output_lock\n"
                            "with output_lock(sys.argv[1], 'training'): pass", str(folder)],
                           env=os.environ | {"PYTHONPATH": str(ROOT)}, capture_output=True, text=True)
        assert p.returncode == 1 and "is in use by training (pid" in p.stderr.splitlines()[-1]
    assert not lock.lock_path(folder).exists() and not folder.exists(), "the lock creates nothing, leaves nothing"
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is a file, not a folder"):
        with lock.output_lock(tmp_path / "file"):
            pass


# -------------------------------------------------------------------------------------- identities


def test_another_identity_is_measured_beside_the_old_one_never_over_it(tmp_path, producer):
    root = tmp_path / "data" / "cpu"
    _sweep(tmp_path)
    before = _tables(root / "baseline")
    (steps,) = _sweep(tmp_path, params={"micro_steps": 2})
    assert steps["status"] == "ok" and Path(steps["folder"]).name.startswith("baseline~"), steps
    assert _sweep(tmp_path, params={"micro_steps": 2})[0]["status"] == "done before"
    assert _sweep(tmp_path)[0]["status"] == "done before"
    assert _same(_tables(root / "baseline"), before)
    recorded = json.loads(read_table(Path(steps["folder"]) / "run.parquet").loc[0, "identity"])
    assert recorded["steps"] == 2 and recorded["data"] == "mni" and recorded["label"] == "cpu"
    assert recorded["switches"] == identity.switches_on(get_config("baseline").flags)
    assert Path(steps["folder"]).name == "baseline~" + identity.key(identity.encode(recorded))
    assert [r["run_id"] for r in sw._main_runs(root)] == [before["run.parquet"].loc[0, "run_id"]], \
        "the summary compares the main runs only"
    with warnings.catch_warnings():
        warnings.simplefilter("error", loading.DataWarning)
        assert loading.runs(tmp_path / "data")["folder"].tolist() == ["cpu/baseline"]
        assert sorted(loading.runs(tmp_path / "data", variants=True)["folder"]) == [
            "cpu/baseline", f"cpu/{Path(steps['folder']).name}"]


H100 = "nvidia-h100-80gb-hbm3"
PAPER_ON_H100 = ("baseline", "opt1", "opt2", "opt12", "bf16", "fp16", "best")


def test_a_switch_added_or_retired_since_a_run_leaves_its_identity_the_same():
    """A run records its switches where they are on: one added later is off in every run recorded before it, one
    retired was off in every run the product can still make. The H100's committed rows recorded every switch of
    their day; a sweep today finds each of them measured, in its own folder. A switch on, new or retired, is another
    identity."""
    found = sw.measured_before(",".join(PAPER_ON_H100), preset="paper", gpu_label=H100, out=REPO / "data")
    assert found == {c: REPO / "data" / H100 / c for c in PAPER_ON_H100}
    (plan,) = sw.plan_runs("best", preset="paper", gpu_label=H100)
    fields = json.loads(plan.identity)
    assert fields["switches"] == identity.switches_on(get_config("best").flags) and "tap_major" not in fields["switches"]
    every = get_config("best").flags | schema.RETIRED_SWITCHES  # as a run of a day with every one of them recorded it
    old = identity.encode(fields | {"switches": dict(sorted(every.items()))})
    assert old != plan.identity and identity.same(old, plan.identity)
    assert identity.folder_name("best", old, plan.default) == "best" and identity.key(old) == identity.key(plan.identity)
    for on in ({"tap_major": True}, {"conv": "triton"}, {"precision": "fp32"}):
        other = identity.encode(fields | {"switches": dict(sorted((every | on).items()))})
        assert not identity.same(other, plan.identity), on
        assert identity.folder_name("best", other, plan.default) == f"best~{identity.key(other)}"
        assert not sw.stands((other, "ok"), plan.identity)
    assert identity.canonical("") == "" and identity.canonical("not json") == "not json"


def test_measured_before_names_what_the_sweep_skips_and_nothing_else(tmp_path, producer):
    def before(**kw):
        return sw.measured_before("baseline,opt1", preset="smoke", out=tmp_path / "data", gpu_label="cpu", **kw)

    assert before() == {"baseline": None, "opt1": None}
    producer["opt1"] = "fail"
    _sweep(tmp_path, "baseline,opt1")
    assert before() == {"baseline": tmp_path / "data" / "cpu" / "baseline", "opt1": None}, "an error row is measured again"
    assert before(params={"micro_steps": 2}) == {"baseline": None, "opt1": None}, "another identity is not measured yet"
    (steps,) = _sweep(tmp_path, params={"micro_steps": 2})
    assert before(params={"micro_steps": 2})["baseline"] == Path(steps["folder"])
    assert [r["status"] for r in _sweep(tmp_path, "baseline,opt1")] == ["done before", "error"]


def test_a_row_without_an_identity_counts_as_its_folder_s_default(tmp_path, producer):
    root = tmp_path / "data" / "cpu"
    _sweep(tmp_path)
    df = read_table(root / "baseline" / "run.parquet")
    write_table(df.assign(identity=""), root / "baseline" / "run.parquet", "run")  # as committed rows read
    assert _sweep(tmp_path)[0]["status"] == "done before"
    assert Path(_sweep(tmp_path, params={"warmup": 7})[0]["folder"]).name.startswith("baseline~")


def test_a_data_folder_s_fingerprint_changes_with_its_files(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.nii").write_bytes(b"1")
    first = identity.data_fingerprint(str(tmp_path / "d"))
    (tmp_path / "d" / "b.nii").write_bytes(b"2")
    assert identity.data_fingerprint(str(tmp_path / "d")) != first
    assert identity.data_fingerprint("mni") == "mni"


# -------------------------------------------------------------------------------------- hostile strings


@pytest.mark.parametrize("args, named", [
    (["--qos", "normal\ntouch /tmp/pwned"], "--qos"),
    (["--gpu-label", "h100\nrm -rf ~"], "--gpu-label"),
    (["--partition", "gpu\r"], "--partition"),
    (["--gpu-type", "h100\x1b[2J"], "--gpu-type"),
    (["--gpu-label", ".."], "a label needs a letter or a digit"),
])
def test_a_control_character_or_an_empty_label_never_reaches_a_job_script(tmp_path, capsys, args, named):
    rc, lines = _cli(capsys, "sweep", "--backend", "slurm", "--dry-run", "--configs", "baseline",
                     "--out", str(tmp_path / "data"), "--slurm-folder", str(tmp_path / "jobs"), *args)
    out = capsys.readouterr().out
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: ") and named in lines[0], lines
    assert "#SBATCH" not in out and not (tmp_path / "jobs").exists()


@pytest.mark.parametrize("label", ["..", "a\nb"])
def test_a_bad_label_or_phase_fails_a_sweep_here_before_any_work(tmp_path, capsys, label):
    rc, lines = _cli(capsys, "sweep", "--configs", "baseline", "--out", str(tmp_path / "data"), "--device", "cpu",
                     "--gpu-label", label)
    assert rc == 2 and len(lines) == 1 and "--gpu-label" in lines[0]
    assert not (tmp_path / "data").exists()
    with pytest.raises(ValueError, match="unknown phase.*bogus"):
        _sweep(tmp_path, params={"phases": "sample,bogus"})
    assert not (tmp_path / "data").exists()


# -------------------------------------------------------------------------------------- a full disk


@pytest.mark.parametrize("where", ["writing a table", "publishing"])
def test_a_full_disk_says_so_in_one_line_and_loses_nothing(tmp_path, capsys, producer, monkeypatch, where):
    root = tmp_path / "data" / "cpu"
    _sweep(tmp_path)
    before = _tables(root / "baseline")
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    if where == "writing a table":  # the sweep's own write of the run row, after the notebook
        real, stamp = os.replace, sw._stamp
        armed = []

        def replace(a, b):
            if armed:
                raise full
            real(a, b)

        monkeypatch.setattr(storage.os, "replace", replace)
        monkeypatch.setattr(sw, "_stamp", lambda *a: (armed.append(1), stamp(*a)))
    else:
        monkeypatch.setattr(storage, "_exchange", lambda a, b: (_ for _ in ()).throw(storage.storage_error(b, full)))
    rc, lines = _cli(capsys, "sweep", "--configs", "baseline", "--out", str(tmp_path / "data"), "--device", "cpu",
                     "--gpu-label", "cpu", "--force")
    assert rc == 2 and len(lines) == 1, lines
    assert lines[0].startswith("error: cannot write ")
    assert lines[0].endswith("the disk is full (no space left on device)")
    monkeypatch.undo()
    assert _same(_tables(root / "baseline"), before)
    assert not list(root.glob(".*")), "no staging folder left taking space"
    assert _sweep(tmp_path)[0]["status"] == "done before"


def test_files_respect_the_umask(tmp_path):
    old = os.umask(0o027)
    try:
        storage.atomic_write(tmp_path / "a", lambda f: f.write(b"x"))
        os.umask(0o002)
        storage.atomic_write(tmp_path / "b", lambda f: f.write(b"x"))
    finally:
        os.umask(old)
    assert (tmp_path / "a").stat().st_mode & 0o777 == 0o640
    assert (tmp_path / "b").stat().st_mode & 0o777 == 0o664


# -------------------------------------------------------------------------------------- exit code


def test_the_sweep_exits_1_when_a_configuration_failed_and_says_which(tmp_path, capsys, producer):
    producer["opt1"] = "fail"
    rc, lines = _cli(capsys, "sweep", "--configs", "baseline,opt1", "--out", str(tmp_path / "data"),
                     "--device", "cpu", "--gpu-label", "cpu")
    assert rc == 1 and lines == ["1 of 2 configuration(s) measured; failed: opt1 (error)"], lines
    producer["opt1"] = "ok"
    rc, lines = _cli(capsys, "sweep", "--configs", "baseline,opt1", "--out", str(tmp_path / "data"),
                     "--device", "cpu", "--gpu-label", "cpu")
    assert rc == 0 and lines == ["2 of 2 configuration(s) measured"], lines


# -------------------------------------------------------------------------------------- schema and loader


def _row(env, **kw) -> pd.DataFrame:
    row = run_row(get_config("baseline"), "smoke", env=env, gpu_name="cpu", label="cpu", status="ok", message="")
    return pd.DataFrame([row | kw])


@pytest.mark.parametrize("table, change, column", [
    ("run", {"run_id": None}, "run_id"),
    ("run", {"run_id": ""}, "run_id"),
    ("run", {"status": "bogus"}, "status"),
    ("steps", {"micro_step": [0, 0]}, "run_id, phase, micro_step"),
    ("steps", {"micro_step": [0, -1]}, "micro_step"),
    ("steps", {"run_id": ["a", "b"]}, "run_id"),
])
def test_schema_value_checks_name_the_column(tmp_path, env, table, change, column):
    if table == "run":
        df = _row(env).assign(**change)
    else:
        df = pd.DataFrame({"run_id": "a", "phase": "train", "micro_step": [0, 1], "timed": True, "step_ms": 1.0,
                           "dispatch_ms": 0.1, "loss": 0.5, "peak_mem_bytes": -1}).assign(**change)
    with pytest.raises(schema.SchemaError, match=f"column[s]? {column}") as e:
        write_table(df, tmp_path / f"{table}.parquet", table)
    assert "\n" not in str(e.value)
    df.to_parquet(tmp_path / f"{table}.parquet")  # written by other means: refused on read as well
    with pytest.raises(schema.SchemaError, match=f"{table}.parquet: column[s]? {column}"):
        read_table(tmp_path / f"{table}.parquet")


def test_a_table_rewritten_by_pandas_unchanged_still_reads(tmp_path, env):
    path = tmp_path / "run.parquet"
    write_table(_row(env), path, "run")
    before = read_table(path)
    pd.read_parquet(path).to_parquet(path)
    assert read_table(path).equals(before)
    pd.read_parquet(path).assign(batch="many").to_parquet(path)
    with pytest.raises(schema.SchemaError, match="column batch is (large_)?string, expected int64"):
        read_table(path)


def test_one_bad_folder_is_named_and_left_out_the_rest_is_shown(tmp_path, producer, monkeypatch):
    _sweep(tmp_path, "baseline,opt1,opt2,opt12")
    root = tmp_path / "data" / "cpu"
    (root / "opt2" / "run.parquet").unlink()  # an incomplete run
    os.replace(root / "opt1" / "steps.parquet", root / "opt12" / "steps.parquet")  # another run's table
    (root / "opt1" / "run.parquet").write_bytes(b"not parquet")
    with pytest.warns(loading.DataWarning) as caught:
        data = loading.load_all(tmp_path / "data")
    messages = sorted(str(w.message) for w in caught)
    assert list(data.run["config"]) == ["baseline", "opt12"]
    assert sorted(data.steps["config"].unique()) == ["baseline"]
    assert any(f"incomplete run {root / 'opt2'}" in m for m in messages)
    assert any(str(root / "opt1" / "run.parquet") in m for m in messages)
    assert any(str(root / "opt12" / "steps.parquet") in m and "is not the run of its folder" in m for m in messages)
    assert all("\n" not in m for m in messages)
    monkeypatch.setenv("MEDDDPM_STRICT_DATA", "1")  # the published book's build: every folder must read
    with pytest.raises(loading.DataError, match="opt"):
        loading.load_all(tmp_path / "data")


def test_the_ablation_page_reads_one_identity_per_configuration(tmp_path, producer):
    _sweep(tmp_path, "best", group="ablation")
    (other,) = _sweep(tmp_path, "best", group="ablation", params={"micro_steps": 5})
    assert Path(other["folder"]).name.startswith("best~")
    assert loading.ablation_runs(tmp_path / "data")["folder"].tolist() == ["cpu/ablation/best"]
    assert len(loading.ablation_runs(tmp_path / "data", variants=True)) == 2
