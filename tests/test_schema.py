import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from medddpm.store import layout, schema


def _steps(**over):
    row = dict(run_id="cpu/baseline/x", phase="train", micro_step=0, timed=True, step_ms=1.5, dispatch_ms=0.1, loss=0.8,
               peak_mem_bytes=-1) | over
    return pd.DataFrame([row])


def test_round_trip_keeps_types(tmp_path):
    path = schema.write_table(_steps(), tmp_path / "steps.parquet", "steps")
    back = schema.read_table(path)
    assert back.dtypes["micro_step"] == "int64" and back.dtypes["timed"] == "bool" and back.loc[0, "loss"] == 0.8
    assert not list(tmp_path.glob(".*tmp")), "atomic write leaves no temporary file"


@pytest.mark.parametrize("df, message", [
    (_steps().drop(columns=["loss"]), "missing columns \\['loss'\\]"),
    (_steps().assign(extra=1), "unexpected columns \\['extra'\\]"),
    (_steps(micro_step="three"), "steps table"),
    (_steps(timed="yes"), "steps table"),
])
def test_bad_tables_are_refused_on_write(df, message, tmp_path):
    with pytest.raises(schema.SchemaError, match=message):
        schema.write_table(df, tmp_path / "steps.parquet", "steps")
    assert not (tmp_path / "steps.parquet").exists()


def test_read_checks_the_schema_and_names_the_file(tmp_path):
    bad = tmp_path / "steps.parquet"
    _steps().drop(columns=["loss"]).to_parquet(bad)
    with pytest.raises(schema.SchemaError, match="steps.parquet"):
        schema.read_table(bad)
    with pytest.raises(FileNotFoundError, match="missing data file"):
        schema.read_table(tmp_path / "kernels.parquet")
    with pytest.raises(schema.SchemaError, match="unknown table"):
        schema.arrow_schema("nope")


def test_every_table_has_documented_columns_and_the_issue_minimum():
    minimum = {
        "run": {"run_id", "status", "message", "gpu_name", "gpu_count", "driver", "cuda", "cudnn", "torch", "python",
                "git_commit", "container", "size", "batch", "parameters", "flops_per_step", "start_time",
                "precision", "channels_last", "compile", "cuda_graphs", "fused_adam", "attention"},
        "steps": {"phase", "micro_step", "timed", "step_ms", "loss", "peak_mem_bytes"},
        "kernels": {"kernel", "category", "pass", "calls", "total_us"},
        "ncu": {"kernel", "metric", "value", "unit"},
        "quality": {"step", "loss", "baseline_loss", "rel_err"},
    }
    for table, cols in minimum.items():
        assert cols <= set(schema.TABLES[table]), table
        assert all(desc for _, desc in schema.TABLES[table].values())
    assert "| `step_ms` |" in schema.markdown() and "**bench.parquet**" in schema.markdown()
    empty = schema.empty("quality")
    assert empty.empty and list(empty.columns) == list(schema.TABLES["quality"])


def test_every_configuration_switch_is_a_run_column():
    from medddpm.configs import CONFIGS

    flags = set(next(iter(CONFIGS.values())).flags)
    assert flags <= set(schema.TABLES["run"]), f"run table lacks {sorted(flags - set(schema.TABLES['run']))}"


def test_a_table_written_before_a_column_was_added_reads_with_its_default(tmp_path):
    from medddpm.configs import get_config
    from medddpm.measure.run import run_row

    env = dict(gpu_count=0, driver="", cuda="", cudnn="", torch="2", python="3", cpu="x", host_threads=2,
               git_commit="abc", container="")
    row = run_row(get_config("baseline"), "smoke", env=env, gpu_name="cpu", status="ok", message="")
    old = pd.DataFrame([row]).drop(columns=["upsample"])

    def write(df):
        want = schema.arrow_schema("run")
        typed = pa.schema([f for f in want if f.name in df.columns])
        pq.write_table(pa.Table.from_pandas(df, schema=typed, preserve_index=False), tmp_path / "run.parquet")

    write(old)
    back = schema.read_table(tmp_path / "run.parquet")
    assert back.loc[0, "upsample"] == "interpolate" and list(back.columns) == list(schema.TABLES["run"])
    write(old.drop(columns=["attention"]))  # not a later addition: refused
    with pytest.raises(schema.SchemaError, match="run.parquet"):
        schema.read_table(tmp_path / "run.parquet")


def test_columns_added_for_memory_read_from_older_tables(tmp_path):
    """Tables written before the memory columns existed read with what they imply: cubic shape from
    size, one image channel, one residual block a level, no checkpointing, device memory unrecorded."""
    from medddpm.configs import get_config
    from medddpm.measure.run import run_row

    env = dict(gpu_count=0, driver="", cuda="", cudnn="", torch="2", python="3", cpu="x", host_threads=2,
               git_commit="abc", container="")
    rows = [run_row(get_config("baseline"), "paper", env=env, gpu_name="cpu", status="ok", message="")
            | {"size": s, "run_id": f"cpu/baseline/{s}"} for s in (128, 16)]
    new = ["checkpointing", "shape", "image_channels", "num_res_blocks", "gpu_total_bytes", "gpu_other_bytes",
           "upsample"]
    old = pd.DataFrame(rows).drop(columns=new)
    want = schema.arrow_schema("run")
    pq.write_table(pa.Table.from_pandas(old, schema=pa.schema([f for f in want if f.name in old.columns]),
                                        preserve_index=False), tmp_path / "run.parquet")
    back = schema.read_table(tmp_path / "run.parquet")
    assert list(back["shape"]) == ["128x128x128", "16x16x16"]
    assert not back["checkpointing"].any() and (back["image_channels"] == 1).all() and (back["num_res_blocks"] == 1).all()
    assert (back["gpu_total_bytes"] == -1).all() and (back["gpu_other_bytes"] == -1).all()


def test_a_row_with_a_retired_column_still_reads_and_none_is_written_again(tmp_path):
    """Committed runs recorded switches that have since left the product (`schema.RETIRED`): such a row reads
    without them, a new row does not have them, and writing one back refuses them like any unknown column."""
    from medddpm.configs import get_config
    from medddpm.measure.run import run_row

    env = dict(gpu_count=0, driver="", cuda="", cudnn="", torch="2", python="3", cpu="x", host_threads=2,
               git_commit="abc", container="")
    row = run_row(get_config("best"), "smoke", env=env, gpu_name="cpu", status="ok", message="")
    assert not set(schema.RETIRED["run"]) & set(row) and not set(schema.RETIRED["run"]) & set(schema.TABLES["run"])
    retired = dict(split_skip=False, store_norm_grad=False, cudnn_try_all=False, memory_budget=1.0, aot_cse=True,
                   recompute_reads=False, nd_tiling=False, coordinate_descent=False, combo_kernels=False,
                   conv="cudnn", condition_once=False)
    assert set(retired) == set(schema.RETIRED["run"])
    kinds = {"memory_budget": pa.float64(), "conv": pa.string()}
    typed = pa.schema(list(schema.arrow_schema("run")) + [pa.field(k, kinds.get(k, pa.bool_())) for k in retired])
    pq.write_table(pa.Table.from_pandas(pd.DataFrame([row | retired]), schema=typed, preserve_index=False),
                   tmp_path / "run.parquet")
    back = schema.read_table(tmp_path / "run.parquet")
    assert list(back.columns) == list(schema.TABLES["run"]) and back.loc[0, "config"] == "best"
    with pytest.raises(schema.SchemaError, match="unexpected columns"):
        schema.write_table(back.assign(**retired), tmp_path / "again.parquet", "run")


@pytest.mark.parametrize("table", ["steps", "scaling"])
def test_a_table_written_with_time_ms_reads_as_step_ms(tmp_path, table):
    """Tables written before one step's time was named step_ms (`schema.RENAMED`) read under the new name, the
    values as written; writing takes the new name only."""
    assert schema.RENAMED[table]["time_ms"] == "step_ms"
    want = schema.arrow_schema(table)
    if table == "steps":
        new = pd.concat([_steps(), _steps(micro_step=1, step_ms=2.5)], ignore_index=True)
    else:
        new = pd.DataFrame([{n: {"string": "x", "int64": 1, "double": 3.5, "bool": True}[str(f.type)]
                             for n, f in zip(want.names, want)}])
    old = new.rename(columns={"step_ms": "time_ms"})
    typed = pa.schema([pa.field("time_ms" if f.name == "step_ms" else f.name, f.type) for f in want])
    path = tmp_path / f"{table}.parquet"
    pq.write_table(pa.Table.from_pandas(old, schema=typed, preserve_index=False), path)
    back = schema.read_table(path, table)
    assert list(back.columns) == list(schema.TABLES[table]) and "time_ms" not in back
    pd.testing.assert_frame_equal(back, new[list(schema.TABLES[table])])
    with pytest.raises(schema.SchemaError, match=r"unexpected columns \['time_ms'\]"):
        schema.write_table(old, tmp_path / "again.parquet", table)


def test_bench_table_round_trip(tmp_path):
    """A bench invocation's rows (`measure.timing.bench.bench_rows`) write and read back through the schema unchanged."""
    from medddpm.measure.timing.bench import bench_rows

    doc = {"environment": {"gpu_name": "NVIDIA H200", "torch": "2.11", "cudnn": "91900", "git_commit": "abc",
                           "time_utc": "2026-11-29T16:57:12+00:00"},
           "spec": {"size": [160, 192, 144], "mask_channels": 4, "base_channels": 64}, "phase": "train",
           "runs": [{"config": "best", "step_ms": [10.0, 12.0, 11.0], "peak_mem_bytes": 5 * 2**30,
                     "backend_flags": {"cudnn_conv_fp32_precision": "tf32"}},
                    {"config": "reference-tf32", "step_ms": [20.0], "peak_mem_bytes": 6 * 2**30}]}
    rows = bench_rows(doc, source="compare run 1")
    path = schema.write_table(rows, tmp_path / layout.BENCH_FILE, "bench")
    back = schema.read_table(path)
    pd.testing.assert_frame_equal(back, rows)
    assert list(back["gpu_slug"]) == ["nvidia-h200"] * 2 and list(back["config"]) == ["best", "opt1"]
    assert list(back["train_median_ms"]) == [11.0, 20.0] and list(back["size"]) == [192, 192]
    assert back["sample_step_median_ms"].isna().all() and list(back["timed_steps"]) == [3, 1]
    with pytest.raises(schema.SchemaError, match="bench table"):
        schema.write_table(rows.assign(timed_steps="three"), tmp_path / "bad.parquet", "bench")


# the columns that count or index micro-steps, under the names they were first written with
MICRO_STEP_RENAMES = {"steps": {"step": "micro_step"}, "kernels": {"steps": "micro_steps"},
                      "scaling": {"step": "micro_step"}, "bench": {"steps": "timed_steps"}}


def _rows_of(table: str, n: int) -> pd.DataFrame:
    """`n` valid rows of a table: every value a column's type allows, keys unique, one run."""
    want = schema.arrow_schema(table)
    base = {"string": "x", "int64": 1, "double": 0.5, "bool": True}
    rows = pd.DataFrame([{f.name: base[str(f.type)] for f in want}] * n)
    for column in schema.KEYS.get(table, ()):
        if str(want.field(column).type) == "int64":
            rows[column] = range(n)
    for column, allowed in schema.ENUMS.get(table, {}).items():
        rows[column] = allowed[0]
    return rows


@pytest.mark.parametrize("table", sorted(MICRO_STEP_RENAMES))
def test_a_table_written_with_the_old_micro_step_names_reads_under_the_new_ones(tmp_path, table):
    """A steps, kernels, scaling or bench table written before a micro-step's index or count was named for it (a
    step is an optimizer step) reads under today's names, every row and value as written; writing takes the new
    names only."""
    renames = MICRO_STEP_RENAMES[table]
    assert renames.items() <= schema.RENAMED[table].items()
    new = _rows_of(table, 4)
    (new_name,) = renames.values()
    new[new_name] = [0, 1, 2, 3]
    back_to_old = {v: k for k, v in renames.items()}
    old = new.rename(columns=back_to_old)
    typed = pa.schema([pa.field(back_to_old.get(f.name, f.name), f.type) for f in schema.arrow_schema(table)])
    path = tmp_path / f"{table}.parquet"
    pq.write_table(pa.Table.from_pandas(old, schema=typed, preserve_index=False), path)
    back = schema.read_table(path, table)
    assert list(back.columns) == list(schema.TABLES[table]) and not set(renames) & set(back.columns)
    pd.testing.assert_frame_equal(back, new[list(schema.TABLES[table])])
    with pytest.raises(schema.SchemaError, match="unexpected columns"):
        schema.write_table(old, tmp_path / "again.parquet", table)


def test_optimizer_step_columns_keep_their_names():
    """`step` and `steps` name optimizer steps wherever they remain; a micro-step's column says micro_step(s)."""
    assert "step" in schema.TABLES["quality"] and "step" in schema.TABLES["convergence_losses"]
    assert "steps" in schema.TABLES["convergence_runs"]
    for table in ("steps", "scaling", "kernels", "bench"):
        assert not {"step", "steps"} & set(schema.TABLES[table]), table
