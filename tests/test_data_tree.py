"""The map of the data tree (`medddpm.store.layout`): every file of the committed tree is one it names, and reads
as the table its place says; folder names round-trip."""

from pathlib import Path

import pyarrow.parquet as pq
import pytest

from medddpm.store import layout, schema

DATA = Path(__file__).resolve().parents[1] / "data"


def named(rel: Path) -> bool:
    """Whether a file's path under the data root is one the map names."""
    parts = rel.parts
    if parts == (layout.PARTITION_FILE,):
        return True
    label, *rest = parts
    if rest == [layout.ROOFS_FILE]:
        return True
    if len(rest) == 2 and rest[0] == layout.SCALING_DIR:
        return rest[1].endswith(".parquet")
    if rest[:1] == [layout.CONVERGENCE_DIR]:
        return (len(rest) == 2 and rest[1] in {f"{t}.parquet" for t in layout.CONVERGENCE_TABLES}
                or rest[1:2] == [layout.SLICES_DIR])
    if rest[:1] == [layout.LEVERS_DIR]:
        return (len(rest) == 2 and rest[1] in {f"{t}.parquet" for t in layout.LEVERS_TABLES}
                or len(rest) == 3 and rest[2] in {f"{t}.parquet" for t in layout.LEVER_RUN_TABLES})
    if rest[:1] == [layout.ABLATION_DIR]:
        rest = rest[1:]
    if len(rest) != 2:
        return False
    folder, name = rest
    if name == layout.BENCH_FILE:
        return True
    return name in {f"{t}.parquet" for t in layout.RUN_TABLES} | {layout.NOTEBOOK_FILE, layout.KERNEL_LOG}


FILES = sorted(p.relative_to(DATA) for p in DATA.rglob("*") if p.is_file()
               and not any(layout.hidden(part) for part in p.relative_to(DATA).parts))


def test_every_committed_file_is_one_the_map_names():
    assert len(FILES) > 100
    unnamed = [str(f) for f in FILES if not named(f)]
    assert not unnamed, f"files of data/ the map does not name: {unnamed[:5]}"


@pytest.mark.parametrize("rel", [f for f in FILES if f.suffix == ".parquet"], ids=str)
def test_every_committed_table_reads_as_the_table_its_place_says(rel):
    table = layout.table_of(rel)
    assert table in schema.TABLES, rel
    df = schema.read_table(DATA / rel)  # the table's name taken from its place
    # under today's names (a column renamed since, `schema.RENAMED`, reads under its new one), every row kept
    assert list(df.columns) == list(schema.TABLES[table])
    assert len(df) == pq.ParquetFile(DATA / rel).metadata.num_rows


def test_every_run_folder_holds_its_run_and_notebook():
    runs = [f.parent for f in FILES if f.name == layout.RUN_FILE]
    assert runs
    for folder in runs:
        assert layout.is_run(DATA / folder) and (DATA / folder / layout.NOTEBOOK_FILE).is_file(), folder


@pytest.mark.parametrize("config, preset, batch, folder", [
    ("best", "paper", 1, "best"), ("baseline", "smoke", 1, "baseline"), ("best", "brats", 1, "best@brats"),
    ("best-ckpt", "brats", 2, "best-ckpt@brats-b2"), ("opt1", "paper", 2, "opt1@paper-b2"),
])
def test_run_folder(config, preset, batch, folder):
    assert layout.run_folder(config, preset, batch) == folder


def test_a_writers_folders_are_hidden_and_lead_back_to_their_run(tmp_path):
    final = tmp_path / "nvidia-h200" / "best~1a2b3c4d"
    stage, old = layout.stage_folder(final, 42), layout.old_folder(final, 42)
    for made in (stage, old, layout.run_lock_file(final.parent, "best")):
        assert made.parent == final.parent and layout.hidden(made.name)
    assert layout.leftover_of(stage.name) == layout.leftover_of(old.name) == final.name
    for p in (stage, old):
        p.mkdir(parents=True)
    found = sorted(p for pattern in layout.leftover_patterns("best") for p in final.parent.glob(pattern))
    assert found == sorted([stage, old])


def test_the_data_root_is_the_environment_s_else_the_checkout_s(monkeypatch, tmp_path):
    monkeypatch.setenv("MEDDDPM_DATA", str(tmp_path))
    assert layout.data_root() == tmp_path
    monkeypatch.setenv("MEDDDPM_DATA", "")  # an empty value is unset, never the working directory
    assert layout.data_root() == DATA


def test_committed_tables_of_the_old_micro_step_names_read_under_the_new_ones():
    """The committed steps, kernels, scaling and bench tables were written before a micro-step's index or count was
    named for it: they stay as measured, and read as micro_step, micro_steps and timed_steps."""
    seen = set()
    for rel in (f for f in FILES if f.suffix == ".parquet"):
        table = layout.table_of(rel)
        old = set(schema.RENAMED.get(table, {})) & set(pq.read_schema(DATA / rel).names)
        if not old:
            continue
        seen.add(table)
        df = schema.read_table(DATA / rel)
        assert {schema.RENAMED[table][o] for o in old} <= set(df.columns) and not old & set(df.columns), rel
    assert {"steps", "kernels", "scaling", "bench"} <= seen, seen
