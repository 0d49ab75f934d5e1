"""What a compiled step saves for its backward (medddpm.measure.memory.partition), read from AOTAutograd's partition
on the CPU at the smoke size. The H200 measured what these tests check in miniature: `best-ckpt`
keeps less than `best` (peaks at 128^3: 3.98 GiB against 6.86 GiB)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from medddpm import report
from medddpm.model import unet as model
from medddpm.measure.memory import partition
from medddpm.cli.main import main
from medddpm.configs import CONFIGS
from medddpm.presets import get_preset
from medddpm.measure.memory.partition import activation_bytes, saved_tensors, summary
from medddpm.store.schema import read_table

REPO = Path(__file__).resolve().parents[1]

SPEC = get_preset("smoke").spec()  # 16^3, 32 base channels
SKIP = (1, SPEC.base_channels, *SPEC.shape)  # the stem's output: the top level's skip connection


@pytest.fixture(scope="module")
def saved():
    return {name: saved_tensors(SPEC, name) for name in ("best", "best-ckpt", "best-ckpt+narrow_checkpoints=false")}


@pytest.mark.slow
def test_rows_are_the_forward_graph_s_saved_tensors(saved):
    df = saved["best"]
    assert list(df.columns) == ["name", "op", "input", "shape", "dtype", "bytes"]
    size = {"bfloat16": 2, "float32": 4, "int64": 8}
    assert (df["bytes"] == [math.prod(s) * size[d] for s, d in zip(df["shape"], df["dtype"])]).all()
    # The step's parameters reach the backward as inputs (held anyway), the activations as made in the forward.
    assert df["input"].any() and (~df["input"]).sum() > 50
    assert activation_bytes(df) == df.loc[~df["input"], "bytes"].sum()
    groups = summary(df)
    assert groups["count"].sum() == (~df["input"]).sum()
    assert groups["gib"].is_monotonic_decreasing
    # bf16 autocast: the convolutions' outputs are kept in bf16 at the top level
    assert ((df["shape"] == SKIP) & (df["dtype"] == "bfloat16") & ~df["input"]).sum() >= 4


@pytest.mark.slow
def test_checkpointing_keeps_less(saved):
    assert activation_bytes(saved["best-ckpt"]) < 0.8 * activation_bytes(saved["best"])


@pytest.mark.slow
def test_narrow_checkpoints_keep_no_stem_output(saved, monkeypatch):
    """best-ckpt (narrow_checkpoints) keeps its top level's three block outputs and not the stem's, which the
    first encoder block and the last decoder block each recompute. Without `model._realized` the two stems are
    the same ops on the same input, CSE makes them one node, and the partitioner saves the node the two
    checkpoints share: the stem's output, 0.25 GiB live through the H200's whole backward at 128^3
    (events 26 -> 2368 of the step's 2,904 in its allocator snapshot); with `_realized` best-ckpt's peak fell
    from 4.23 to 3.98 GiB."""
    def top(df):
        return df[(df["shape"] == SKIP) & ~df["input"]]

    assert len(top(saved["best-ckpt"])) == 3 and "aten.convolution.default" not in set(top(saved["best-ckpt"])["op"])
    plain = top(saved["best-ckpt+narrow_checkpoints=false"])
    assert len(plain) == 4 and "aten.convolution.default" in set(plain["op"])  # the stem's output, kept
    monkeypatch.setattr(model, "_realized", lambda x: x)
    # traced again with the stems alike, past the cache: the other tests read the traces kept there
    again = partition._saved_tensors.__wrapped__(SPEC, CONFIGS["best-ckpt"])
    assert "aten.convolution.default" in set(top(again)["op"])


def test_an_eager_configuration_has_no_partition(capsys):
    with pytest.raises(ValueError, match="not compiled"):
        saved_tensors(SPEC, "sdpa")
    assert main(["saved", "--preset", "smoke", "--configs", "best,sdpa"]) == 2
    assert "not compiled, so no partition to read: sdpa" in capsys.readouterr().err
    assert main(["saved", "--preset", "smoke", "--configs", "bestt"]) == 2


@pytest.mark.slow
def test_cli_prints_the_saved_activations(capsys):
    assert main(["saved", "--preset", "smoke", "--configs", "best-ckpt", "--min-mib", "0"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("best-ckpt: ") and "activations saved for the backward" in out
    assert "1x32x16x16x16" in out and "bfloat16" in out


@pytest.mark.slow
def test_write_records_one_row_per_configuration_and_torch_version(tmp_path, capsys, monkeypatch):
    import itertools

    from medddpm.measure import env

    path = tmp_path / "partition.parquet"
    # The committed table is in the repository: the first row written makes the checkout dirty, and the
    # rows after it must still name the commit whose code was traced.
    commits = itertools.count()
    monkeypatch.setattr(env, "git_commit", lambda: f"c{next(commits)}")
    for configs in ("best-ckpt", "best,best-ckpt"):  # the second run replaces best-ckpt's row
        assert main(["saved", "--preset", "smoke", "--configs", configs, "--write", str(path)]) == 0
    assert f"recorded in {path}" in capsys.readouterr().out
    table = read_table(path, "partition")
    assert sorted(table["config"]) == ["best", "best-ckpt"] and set(table["torch"]) == {torch.__version__}
    assert set(table["git_commit"]) == {"c1"}, "one commit for every row a run writes"
    row = table.set_index("config").loc["best-ckpt"]
    saved = saved_tensors(SPEC, "best-ckpt")
    assert (row["preset"], row["shape"]) == ("smoke", "16x16x16")
    assert (row["tensors"], row["activation_bytes"]) == ((~saved["input"]).sum(), activation_bytes(saved))
    assert json.loads(row["switches"]) == CONFIGS["best-ckpt"].flags and "bfloat16" in row["largest"]
    assert not list(tmp_path.glob(".*")), "no temporary file left beside the table"
    # a model that is not a preset's has no name to be recorded under
    assert main(["saved", "--size", "16", "--configs", "best", "--write", str(path)]) == 2
    assert "--write records a preset's model" in capsys.readouterr().err


@pytest.mark.slow
def test_the_memory_page_s_table_is_current():
    """data/partition.parquet (the memory page's table) traces every configuration the page names under
    today's definitions, and a fresh trace of best-ckpt with this torch gives its stored row."""
    kept = report.compiled_saved("paper")
    assert set(kept["config"]) == set(report.COMPILED_SAVED) and kept["current"].all(), \
        kept.loc[~kept["current"], "config"].tolist()
    mine = kept[kept["torch"] == torch.__version__].set_index("config")
    assert set(mine.index) == set(report.COMPILED_SAVED), f"no trace with torch {torch.__version__}"
    fresh = saved_tensors(get_preset("paper").spec(), "best-ckpt")
    assert (mine.loc["best-ckpt", "tensors"], mine.loc["best-ckpt", "activation_bytes"]) == (
        (~fresh["input"]).sum(), activation_bytes(fresh))
    assert mine.loc["best-ckpt", "activations_gib"] < mine.loc["best", "activations_gib"]
    with pytest.raises(report.DataError, match="python -m medddpm saved --preset paper"):
        report.compiled_saved("paper", root=REPO / "tests")
