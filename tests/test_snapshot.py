"""Allocator snapshots (`medddpm.measure.memory.snapshot`, `python -m medddpm peak`): the replay against hand-made histories, and
an H200 snapshot of a checkpointed step (`bench --memory-snapshot`) against its bench's own peak."""

from __future__ import annotations

import gzip
import json
import pickle
from pathlib import Path

import pandas as pd
import pytest

from medddpm.measure.memory import snapshot
from medddpm.store import layout
from medddpm.cli.main import main

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "snapshot"
STORE_SKIP = FIXTURES / "memory-best-ckpt_store_skip_grad_true_cuda_graphs_false-e3af6ad.pickle.gz"
MIB = 2**20
MODEL = "/somewhere/medddpm/model.py"
GROUP_NORM = "/somewhere/medddpm/model/group_norm.py"  # the package's GroupNorm, as a frame names it


def frame(name, line, filename=MODEL):
    return {"filename": filename, "line": line, "name": name}


def event(action, addr, size, time_us, frames=()):
    return {"action": action, "addr": addr, "size": size, "stream": 0, "time_us": time_us, "frames": list(frames)}


def history() -> dict:
    """Held: 3 MiB at the end never traced, 2 MiB freed but never allocated in the trace. 4 + 8 MiB allocated
    (the peak: 3+2+4+8), then the 2 and the 4 freed, 1 allocated inside torch, the 8 freed."""
    conv = [frame("call", 10, "/tmp/inductor/cx.py"), frame("forward", 382), frame("_block", 654)]
    stats = [frame("_group_stats", 138), frame("group_norm_chunked", 168)]
    trace = [event("alloc", 0x200, 4 * MIB, 12, conv), event("alloc", 0x300, 8 * MIB, 22, stats),
             event("free_requested", 0x100, 2 * MIB, 23), event("free_completed", 0x100, 2 * MIB, 23),
             event("free_requested", 0x200, 4 * MIB, 25), event("free_completed", 0x200, 4 * MIB, 25),
             event("alloc", 0x400, 1 * MIB, 26, [frame("__call__", 1, "/x/torch/_ops.py")]),
             event("free_requested", 0x300, 8 * MIB, 40)]
    blocks = [{"address": 0x50, "size": 3 * MIB, "requested_size": 3 * MIB, "state": "active_allocated", "frames": []},
              {"address": 0x400, "size": 1 * MIB, "requested_size": 1 * MIB, "state": "active_allocated", "frames": []},
              {"address": 0x900, "size": 5 * MIB, "requested_size": 0, "state": "inactive", "frames": []}]
    return {"segments": [{"device": 0, "address": 0x0, "total_size": 20 * MIB, "blocks": blocks}],
            "device_traces": [trace],
            "external_annotations": [{"stage": "START", "name": "forward", "device": 0, "time_us": 10},
                                     {"stage": "END", "name": "forward", "device": 0, "time_us": 20},
                                     {"stage": "START", "name": "backward", "device": 0, "time_us": 21},
                                     {"stage": "END", "name": "backward", "device": 0, "time_us": 30}]}


def test_peak_replays_the_trace_with_what_was_held_before_it():
    p = snapshot.peak(history())
    assert (p.bytes, p.event, p.events, p.held_bytes, p.phase) == (17 * MIB, 1, 8, 5 * MIB, "backward")
    live = p.live.set_index("address")
    assert sorted(live.index) == [0x50, 0x100, 0x200, 0x300]  # the inactive block and the later alloc are not live
    assert live["bytes"].sum() == p.bytes
    assert live.loc[0x300, "origin"] == "_group_stats (model.py:138)" and live.loc[0x300, "phase"] == "backward"
    assert live.loc[0x200, "origin"] == "forward (model.py:382)" and live.loc[0x200, "callers"] == "_block"
    assert live.loc[0x200, "phase"] == "forward" and live.loc[0x200, "free_event"] == 4
    assert live.loc[0x300, "free_event"] == 7 and live.loc[0x100, "free_event"] == 2
    assert pd.isna(live.loc[0x50, "free_event"])
    assert (live.loc[[0x50, 0x100], "origin"] == snapshot.HELD).all()
    by = p.by_origin()
    assert by["origin"].tolist()[0] == "_group_stats (model.py:138)" and by["bytes"].sum() == p.bytes
    assert by.set_index("origin").loc[snapshot.HELD, "blocks"] == 2


def test_sources_give_qualified_names_and_statements():
    snap = history()
    text = "import torch\n\nclass ResBlock:\n    def forward(self, x):\n        return x + 1\n\n\ndef _group_stats(x):\n" \
           "    return x.var_mean()\n"
    lines = {"forward": 5, "_group_stats": 9, "_block": 99}
    for e in snap["device_traces"][0]:
        for f in e["frames"]:
            f["line"] = lines.get(f["name"], f["line"])
    snap[snapshot.SOURCES] = snapshot.sources(snap, lambda file: text if file == "model.py" else None)
    assert snap[snapshot.SOURCES]["model.py:5"] == {"qualname": "ResBlock.forward", "code": "return x + 1"}
    assert snap[snapshot.SOURCES]["model.py:99"] == {"qualname": "", "code": ""}  # past the end of the module
    live = snapshot.peak(snap).live.set_index("address")
    assert live.loc[0x200, "origin"] == "ResBlock.forward (model.py:5)" and live.loc[0x200, "code"] == "return x + 1"
    assert live.loc[0x300, "origin"] == "_group_stats (model.py:9)"


def test_package_sources_name_the_models_functions():
    line = next(i for i, s in enumerate((snapshot.PACKAGE / "model" / "group_norm.py").read_text().splitlines(), 1)
                if s.startswith("def _group_stats"))
    snap = {"segments": [], "device_traces": [[event("alloc", 1, 1, 0, [frame("_group_stats", line + 1, GROUP_NORM)])]]}
    known = snapshot.sources(snap, snapshot.package_source)
    assert known[f"model/group_norm.py:{line + 1}"]["qualname"] == "_group_stats"


@pytest.mark.parametrize("config,commit,name", [
    ("best-ckpt+store_skip_grad=true+cuda_graphs=false", "e3af6ad3a88de7763088d1adf47b9a1d52622fed",
     "memory-best-ckpt_store_skip_grad_true_cuda_graphs_false-e3af6ad.pickle"),
    ("best-ckpt+narrow_checkpoints=false", "0123456789abcdef-dirty",
     "memory-best-ckpt_narrow_checkpoints_false-0123456.pickle"),
    ("best", "unknown", "memory-best-unknown.pickle")])
def test_snapshot_names_round_trip(config, commit, name):
    assert layout.snapshot_name(config, commit) == name
    short = commit[:7] if commit != "unknown" else ""
    assert layout.parse_snapshot_name(name) == layout.parse_snapshot_name(name + ".gz") == (layout.snapshot_config(config), short)
    with pytest.raises(ValueError, match="not a memory snapshot's name"):
        layout.parse_snapshot_name("best.pickle")


def test_load_rejects_what_is_not_a_snapshot(tmp_path):
    with pytest.raises(FileNotFoundError, match="no memory snapshot"):
        snapshot.load(tmp_path / "memory-x.pickle")
    (tmp_path / "a.pickle").write_bytes(b"not a pickle")
    with pytest.raises(ValueError, match="not a memory snapshot pickle"):
        snapshot.load(tmp_path / "a.pickle")
    (tmp_path / "b.pickle").write_bytes(pickle.dumps({"segments": []}))
    with pytest.raises(ValueError, match="no 'segments' and 'device_traces'"):
        snapshot.load(tmp_path / "b.pickle")
    two = history()
    two["device_traces"].append(list(two["device_traces"][0]))
    with pytest.raises(ValueError, match="events on 2 devices"):
        snapshot.peak(two)


def test_h200_snapshot_matches_its_bench():
    """best-ckpt+store_skip_grad=true+cuda_graphs=false at 128^3 on the H200: traced peak at event 846 in the
    backward, the chunked GroupNorm's 1 GiB float32 gradient live at it, within 0.5% of the peak its bench measured
    over 3 timed steps."""
    p = snapshot.peak(snapshot.load(STORE_SKIP))
    measured = json.loads((FIXTURES / "bench-ckpt-store-skip-nographs.json").read_text())["runs"][0]["peak_mem_bytes"]
    assert p.event == 846 and p.phase == "backward" and abs(p.held_bytes / 2**30 - 0.551) < 0.001
    assert abs(p.bytes - measured) < 0.005 * measured
    top = p.live.iloc[0]
    assert top["bytes"] == 2**30 and top["origin"].startswith("_group_stats (model.py:")
    assert "var_mean" in top["code"]


def test_peak_command(capsys, tmp_path):
    """`peak` reads a snapshot's summary; its pickle only when told to trust it (and then as plain data)."""
    path = tmp_path / "memory-x-0123456.pickle.gz"
    path.write_bytes(gzip.compress(pickle.dumps(history())))
    assert main(["peak", str(path), "--top", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "a pickle, and no summary beside it" in err[0] and "--trust-pickle" in err[0]
    assert main(["peak", str(path), "--top", "2", "--trust-pickle"]) == 0
    trusted = capsys.readouterr().out
    out = trusted.splitlines()
    assert out[0].startswith("memory-x-0123456.pickle.gz: peak 0.017 GiB allocated at event 1 of 8 (backward); 0.005 GiB held")
    assert len(out) == 3 and "_group_stats (model.py:138)" in out[1]
    written = snapshot.write_summary(snapshot.load(path), path)
    assert written.name == "memory-x-0123456.parquet"
    for arg in (path, written):  # the pickle's name: its summary beside it is read
        assert main(["peak", str(arg), "--top", "2"]) == 0
        assert capsys.readouterr().out == trusted
    assert main(["peak", str(tmp_path / "missing.pickle")]) == 2
    assert "error: no memory snapshot" in capsys.readouterr().err


def test_a_summary_holds_the_peak_by_origin():
    """The committed H200 snapshot's summary (lab/scripts/summarise-snapshots.py wrote it) says what its pickle says."""
    p = snapshot.peak(snapshot.load(STORE_SKIP))
    table = snapshot.read_summary(layout.snapshot_summary(STORE_SKIP))
    assert (table["peak_bytes"] == p.bytes).all() and table["bytes"].sum() == p.bytes
    assert (table["peak_event"] == 846).all() and (table["peak_phase"] == "backward").all()
    assert table[["origin", "blocks", "bytes", "largest"]].values.tolist() == \
        p.by_origin()[["origin", "blocks", "bytes", "largest"]].values.tolist()
    assert set(table["config"]) == {"best-ckpt_store_skip_grad_true_cuda_graphs_false"} and set(table["commit"]) == {"e3af6ad"}


def test_bench_writes_its_snapshot_with_the_sources(monkeypatch, tmp_path):
    """`bench --memory-snapshot`'s writer, the CUDA calls stood in for: the history comes back with the package's
    lines named, written whole."""
    import torch

    line = next(i for i, s in enumerate((snapshot.PACKAGE / "model" / "group_norm.py").read_text().splitlines(), 1)
                if s.startswith("def _group_stats"))
    snap = history()
    for e in snap["device_traces"][0]:
        e["frames"] = [frame("_group_stats", line + 1, GROUP_NORM)] if e["frames"] else []
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda *a, **k: calls.append(k))
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", lambda *a, **k: snap)
    path = tmp_path / layout.snapshot_name("best-ckpt", "0123456789")
    snapshot.memory_snapshot(lambda: calls.append("step"), device=torch.device("cuda"), path=path)
    assert calls[1] == "step" and calls[-1] == {"enabled": None}  # the history is switched off again
    written = snapshot.load(path)
    assert written[snapshot.SOURCES][f"model/group_norm.py:{line + 1}"]["qualname"] == "_group_stats"
    assert snapshot.peak(written).live.iloc[0]["origin"] == f"_group_stats (model/group_norm.py:{line + 1})"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([path.name, layout.snapshot_summary(path).name])
    assert snapshot.read_summary(layout.snapshot_summary(path))["origin"].iloc[0] == \
        f"_group_stats (model/group_norm.py:{line + 1})"
    with pytest.raises(ValueError, match="needs a CUDA device"):
        snapshot.memory_snapshot(lambda: None, device=torch.device("cpu"), path=path)
