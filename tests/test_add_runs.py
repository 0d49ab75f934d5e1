"""`python -m medddpm add-runs`: runs measured elsewhere are checked as the project's own and added by the sweep's
rules; each wrong run is refused in one line naming its file, the others are added."""

import json
import shutil
import tarfile
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq
import pytest

from medddpm.cli.main import main
from medddpm.measure.add_runs import Refused, add_runs, check_run
from medddpm.store import identity, schema

DATA = Path(__file__).resolve().parents[1] / "data"
H100 = "nvidia-h100-80gb-hbm3"
RUN = DATA / H100 / "opt1"  # a run with an identity, every table but ncu
OLD = DATA / "nvidia-h200" / "ablation" / "best+compile=false"  # a run of before identities, in a group


@pytest.fixture
def tree(tmp_path):
    """A sweep's --out holding one committed run, the label's roofs and an ablation run of before identities."""
    src = tmp_path / "src"
    shutil.copytree(RUN, src / H100 / "opt1")
    shutil.copy(DATA / H100 / "roofs.parquet", src / H100 / "roofs.parquet")
    shutil.copytree(OLD, src / "nvidia-h200" / "ablation" / OLD.name)
    return src


def _edit(path: Path, **columns):
    """Rewrite a table with columns changed, bypassing the schema (as a hand or another tool would)."""
    df = pq.read_table(path).to_pandas()
    for name, value in columns.items():
        df[name] = value(df) if callable(value) else value
    df.to_parquet(path, index=False)


def _steps(f):
    def edit(path: Path):
        df = pq.read_table(path).to_pandas()
        f(df).to_parquet(path, index=False)
    return edit


ONE = lambda tree: tree / H100 / "opt1"  # noqa: E731


def _identity(**changed):
    def edit(df):
        fields = json.loads(df.loc[0, "identity"]) | changed
        return [identity.encode(fields)]
    return edit


def _rename(folder: Path, name: str) -> Path:
    return folder.rename(folder.with_name(name))


# each corruption of the one run, and the file and words its refusal names
BAD = {
    "a column missing": (lambda r: pq.write_table(pq.read_table(r / "run.parquet").drop_columns(["train_p90_ms"]),
                                                  r / "run.parquet"), "run.parquet", "missing columns ['train_p90_ms']"),
    "steps of another type": (lambda r: _steps(lambda df: df.assign(step_ms=df["step_ms"].astype(str)))(r / "steps.parquet"),
                              "steps.parquet", "step_ms"),
    "two rows": (lambda r: pd.concat([pq.read_table(r / "run.parquet").to_pandas()] * 2).to_parquet(r / "run.parquet"),
                 "run.parquet", "run_id"),
    "a switch changed": (lambda r: _edit(r / "run.parquet", precision="fp32"), "run.parquet", "other switches"),
    "an unknown configuration": (lambda r: _edit(r / "run.parquet", config="fastest"), "run.parquet", "fastest"),
    "the identity's label": (lambda r: _edit(r / "run.parquet", identity=_identity(label="nvidia-h200")),
                             "run.parquet", "label"),
    "an identity that is not JSON": (lambda r: _edit(r / "run.parquet", identity="{config: opt1"), "run.parquet",
                                     "column identity"),
    "the identity's steps": (lambda r: _edit(r / "run.parquet", identity=_identity(steps=3)), "run.parquet", "steps"),
    "the wrong folder": (lambda r: _rename(r, "opt1~0badc0de"), "run.parquet", "not the folder of its identity"),
    "another configuration's folder": (lambda r: _rename(r, "opt12"), "run.parquet", "belongs in opt1"),
    "the label": (lambda r: _edit(r / "run.parquet", gpu_slug="nvidia-h200"), "run.parquet", "label"),
    "status error": (lambda r: _edit(r / "run.parquet", status="error"), "run.parquet", "status error"),
    "p10 above the median": (lambda r: _edit(r / "run.parquet", train_p10_ms=lambda df: df["train_median_ms"] + 1),
                             "run.parquet", "p10 <= median <= p90"),
    "no timed steps": (lambda r: _steps(lambda df: df.assign(timed=False))(r / "steps.parquet"), "steps.parquet",
                       "0 timed training steps"),
    "a step time changed": (lambda r: _steps(lambda df: df.assign(step_ms=df["step_ms"] * 1.5))(r / "steps.parquet"),
                            "steps.parquet", "its timed steps give"),
    "no steps table": (lambda r: (r / "steps.parquet").unlink(), "opt1", "no steps.parquet"),
    "another run's kernels": (lambda r: _edit(r / "kernels.parquet", run_id="elsewhere/opt1/0"), "kernels.parquet",
                              "elsewhere"),
    "a stray file": (lambda r: (r / "notes.txt").write_text("hi"), "notes.txt", "not a file of a run folder"),
    "no notebook": (lambda r: (r / "produce.ipynb").unlink(), "opt1", "produce.ipynb"),
}


@pytest.mark.parametrize("case", BAD)
def test_a_wrong_run_is_refused_in_one_line_naming_its_file_and_the_others_are_added(tree, tmp_path, case):
    corrupt, file, words = BAD[case]
    corrupt(ONE(tree))
    said = add_runs(tree, tmp_path / "data")
    (line,) = said["refused"]
    assert "\n" not in line and file in line and words in line, line
    assert not list((tmp_path / "data" / H100).glob("opt1*")), "nothing of the refused run is copied"
    assert sorted(said["added"]) == [f"added: {tmp_path / 'data' / H100 / 'roofs.parquet'}",
                                     f"added: {tmp_path / 'data' / 'nvidia-h200' / 'ablation' / OLD.name}"]


def test_runs_that_pass_are_added_whole_and_a_second_time_kept(tree, tmp_path):
    out = tmp_path / "data"
    said = add_runs(tree, out)
    assert not said["refused"] and len(said["added"]) == 3
    for rel in (f"{H100}/opt1", f"nvidia-h200/ablation/{OLD.name}"):
        assert sorted(p.name for p in (out / rel).iterdir()) == sorted(p.name for p in (tree / rel).iterdir())
        assert check_run(out / rel, rel.split("/")[0], "ablation" if "ablation" in rel else "")
    assert not [p for p in out.rglob(".*")], "no staging folders or locks left behind"
    again = add_runs(tree, out)
    assert not again["added"] and len(again["kept"]) == 3


def test_a_run_of_another_identity_goes_beside_the_one_there_never_over_it(tree, tmp_path):
    out = tmp_path / "data"
    shutil.copytree(RUN, out / H100 / "opt1")  # the committed run, as the tree has it
    mine = ONE(tree)
    _edit(mine / "run.parquet", identity=_identity(steps=12, warmup=5), timed_steps=12,
          run_id="elsewhere/opt1/1")
    for table in ("steps", "kernels", "quality"):
        _edit(mine / f"{table}.parquet", run_id="elsewhere/opt1/1")
    steps = pq.read_table(mine / "steps.parquet").to_pandas()
    timed = steps.index[(steps["phase"] == "train") & steps["timed"]]
    _steps(lambda df: df.drop(timed[12:]))(mine / "steps.parquet")  # 12 timed steps: the identity says so
    from medddpm.measure.timing.bench import train_summary
    left = pq.read_table(mine / "steps.parquet").to_pandas()
    stats = train_summary(left[(left["phase"] == "train") & left["timed"]]["step_ms"].tolist())
    _edit(mine / "run.parquet", **{k: stats[k] for k in ("train_median_ms", "train_p10_ms", "train_p90_ms")})
    text = pq.read_table(mine / "run.parquet").to_pandas().loc[0, "identity"]
    mine.rename(mine.with_name(f"opt1~{identity.key(text)}"))  # where the sweep writes another identity
    said = add_runs(tree, out)
    assert not said["refused"], said["refused"]
    assert f"added: {out / H100 / f'opt1~{identity.key(text)}'}" in said["added"]
    assert schema.read_table(out / H100 / "opt1" / "run.parquet").loc[0, "run_id"] == \
        schema.read_table(RUN / "run.parquet").loc[0, "run_id"], "the run there stays as it was"


def test_a_tgz_and_a_folder_of_tgz_files_are_read_as_the_tree_they_hold(tree, tmp_path):
    drop = tmp_path / "gpu-runs"
    drop.mkdir()
    (drop / "README.md").write_text("made by the sweep")
    with tarfile.open(drop / "data.tgz", "w:gz") as tar:
        tar.add(tree / H100, arcname=H100)
    said = add_runs(drop / "data.tgz", tmp_path / "a")
    assert len(said["added"]) == 2 and not said["refused"]
    said = add_runs(drop, tmp_path / "b")
    assert len(said["added"]) == 2 and not said["refused"]
    _edit(tree / H100 / "opt1" / "run.parquet", status="error")
    with tarfile.open(drop / "more.tgz", "w:gz") as tar:
        tar.add(tree / H100 / "opt1", arcname=f"{H100}/opt1")
    (drop / "broken.tgz").write_bytes(b"not a tar")
    said = add_runs(drop, tmp_path / "c")
    assert len(said["added"]) == 2, "the readable archive's runs are added"
    broken, error = said["refused"]
    assert "broken.tgz" in broken and "\n" not in broken
    assert error.startswith(f"{drop / 'more.tgz'}:/{H100}/opt1/run.parquet: status error"), error


def test_a_run_being_measured_is_refused_and_added_by_the_next_call(tree, tmp_path):
    import fcntl

    from medddpm.store.layout import run_lock_file

    out = tmp_path / "data"
    lock = run_lock_file(out / H100, "opt1")
    lock.parent.mkdir(parents=True)
    with open(lock, "w") as held:  # as a sweep of another process holds it
        fcntl.flock(held, fcntl.LOCK_EX)
        held.write("pid=1\nhost=elsewhere\nsince=now\nwhat=sweep\n")
        held.flush()
        said = add_runs(tree, out)
    (line,) = said["refused"]
    assert "opt1" in line and "in use" in line, line
    assert f"added: {out / H100 / 'opt1'}" in add_runs(tree, out)["added"]


def test_every_committed_run_passes_the_checks():
    runs = sorted(DATA.glob("*/*/run.parquet")) + sorted(DATA.glob("*/ablation/*/run.parquet"))
    assert len(runs) >= 40
    for path in runs:
        rel = path.parent.relative_to(DATA).parts
        check_run(path.parent, rel[0], rel[1] if len(rel) == 3 else "")


def test_the_command_says_what_it_added_and_exits_1_on_a_refusal(tree, tmp_path, capsys):
    _edit(ONE(tree) / "run.parquet", status="error")
    with pytest.raises(SystemExit) as e:
        main(["add-runs", str(tree), "--out", str(tmp_path / "data")])
    assert e.value.code == 1
    out, err = capsys.readouterr()
    assert "2 added, 0 already in" in out and "1 refused" in out
    assert err.count("\n") == 1 and err.startswith("refused: ") and "status error" in err
    with pytest.raises(Refused):
        check_run(ONE(tree), H100)
