"""A configuration's name never changes meaning: every committed run, main or ablation, was measured under the
switches its name defines today (`python -m medddpm configs --json`), and a row that was not is caught."""

import contextlib
import functools
import io
import json
from pathlib import Path

import pytest

from medddpm.store import schema
from medddpm.cli.main import main
from medddpm.configs import ConfigError, ablation, get_config, mismatch

DATA = Path(__file__).resolve().parent.parent / "data"
RUNS = sorted(DATA.glob("**/run.parquet"))


@functools.cache
def configs_json() -> dict:
    """`python -m medddpm configs --json`, once for every row."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["configs", "--json"]) in (0, None)
    return {r["name"]: r for r in json.loads(out.getvalue())}


def test_the_data_tree_holds_runs():
    assert len(RUNS) >= 20, RUNS


@pytest.mark.parametrize("path", RUNS, ids=lambda p: str(p.parent.relative_to(DATA)))
def test_every_committed_row_matches_its_configuration_today(path):
    row = schema.read_table(path, "run").iloc[0]
    assert mismatch(row) == {}, f"{path} ran as {row['config']} with other switches"
    listed = configs_json().get(row["config"].split("+")[0])
    assert listed is not None, f"{row['config']} is not a named configuration"
    if "+" not in row["config"]:  # a variant's switches are its base's, with the change its name spells
        assert all(listed[k] == row[k] for k in get_config(row["config"]).flags), path


def test_a_row_measured_under_other_switches_is_caught():
    row = dict(get_config("best").flags, config="best")
    assert mismatch(row) == {}
    assert mismatch(row | {"tap_gemm": False}) == {"tap_gemm": (False, True)}
    assert mismatch(dict(get_config("best+tap_gemm=false").flags, config="best+tap_gemm=false")) == {}
    with pytest.raises(ConfigError):
        mismatch(row | {"config": "fastest"})


def test_the_ablation_takes_each_lever_away_once():
    names = [c.name for c in ablation("best")]
    assert names[0] == "best" and len(names) == len(set(names))
    levers = {n.split("+", 1)[1].split("=")[0] for n in names[1:]}
    best, default = get_config("best").flags, get_config("baseline").flags
    assert levers == {k for k in best if best[k] != default[k]}
    assert "best+precision=tf32" in names  # bf16 is weighed against TF32
    for c in ablation("best")[1:]:
        assert get_config(c.name) == c and sum(c.flags[k] != best[k] for k in best) == 1
    assert [c.name for c in ablation("opt12")] == ["opt12", "opt12+precision=fp32", "opt12+channels_last=false"]
