"""What a configuration's compiled training step keeps for its backward: the tensors AOTAutograd's
partitioner saves between the forward and backward graphs, traced at full size on the CPU.

Dynamo and AOTAutograd trace on fake tensors, so no kernel runs and no activation is allocated;
Inductor is stopped after the partition, before code generation. A 128^3 configuration takes about
20 s on two cores. The graph is the CPU's (its autocast rules and decompositions), which can differ from
a GPU's in detail. The saved set is a large part of a compiled step's peak memory, not the peak: the
backward's own buffers and the training state add the rest, so two configurations with equal saved sets can
peak more than a GiB apart (the memory page measures the peaks)."""

from __future__ import annotations

import datetime as dt
import functools
import json
import os

import pandas as pd
import torch

from medddpm.store import schema
from medddpm.configs import Config, get_config
from medddpm.train.engine import Engine, inductor_options
from medddpm.measure.env import git_commit
from medddpm.model.unet import ModelSpec

_GIB = 2**30
KEY = ["preset", "config", "torch"]  # one row per model, configuration and tracing torch


class _Partitioned(Exception):
    """Raised from Inductor's forward compile once the saved tensors are read: nothing to generate."""


def saved_tensors(spec: ModelSpec, config: Config | str) -> pd.DataFrame:
    """One row per tensor the forward graph hands to the backward graph: node name, the operator that
    makes it, whether it is an input of the step (a parameter or the data, held anyway), shape, dtype
    and bytes. A graph break raises (the step must be one graph to be read). Traced once per process
    for each model and configuration (the memory page and the tests ask for the same ones)."""
    return _saved_tensors(spec, get_config(config)).copy()


@functools.lru_cache(maxsize=16)
def _saved_tensors(spec: ModelSpec, config: Config) -> pd.DataFrame:
    engine = Engine(spec, config, device="cpu", ema=False)
    if not engine.run.compile:
        raise ValueError(f"{config.name}: not compiled, so there is no partition to read; "
                         "eager memory is flops.saved_activation_bytes")
    options = inductor_options(engine.run)
    out_shape = (1, spec.image_channels, *spec.shape)
    rows: list[dict] = []

    def read_forward(gm: torch.fx.GraphModule, example_inputs, *args, **kwargs):
        outputs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        tensors = [n for n in outputs if isinstance(n, torch.fx.Node) and isinstance(n.meta.get("val"), torch.Tensor)]
        # The forward graph returns the model's output first, then what the backward needs.
        first = tuple(tensors[0].meta["val"].shape)
        assert first == out_shape, f"the forward graph's first output is {first}, not the model's {out_shape}"
        for n in tensors[1:]:
            val = n.meta["val"]
            rows.append({"name": n.name, "op": str(n.target), "input": n.op == "placeholder",
                         "shape": tuple(int(s) for s in val.shape), "dtype": str(val.dtype).removeprefix("torch."),
                         "bytes": int(val.numel()) * val.element_size()})
        raise _Partitioned

    # As Engine compiles it, with the caches off: a cached graph of an earlier compile skips the partition.
    # AOTAutograd's cache is functorch config, not Inductor's, so it is patched around the compile.
    def backend(gm, example_inputs):
        import torch._functorch.config
        from torch._inductor.compile_fx import compile_fx

        with torch._functorch.config.patch(enable_autograd_cache=False):
            return compile_fx(gm, example_inputs, config_patches=options | {"fx_graph_cache": False},
                              inner_compile=read_forward)

    torch._dynamo.reset()
    model = torch.compile(engine.model, dynamic=False, fullgraph=True, backend=backend)
    x0 = engine.prepare(torch.zeros(out_shape))
    cond = engine.prepare(torch.zeros(1, spec.mask_channels, *spec.shape))
    try:
        with engine.autocast():
            engine.diffusion.loss(model, x0, cond)
    except Exception as error:  # Dynamo wraps a backend's exception (BackendCompilerFailed)
        if not any(isinstance(e, _Partitioned) for e in _chain(error)):
            raise
    finally:
        torch._dynamo.reset()
    assert rows, f"{config.name}: the forward graph saved nothing for a backward"
    return pd.DataFrame(rows)


def _chain(error: BaseException):
    while error is not None:
        yield error
        error = error.__cause__ or error.__context__


def activation_bytes(saved: pd.DataFrame) -> int:
    """Bytes of the saved tensors that the forward allocates (the step's inputs are held anyway)."""
    return int(saved.loc[~saved["input"], "bytes"].sum())


def summary(saved: pd.DataFrame, *, min_bytes: int = 0) -> pd.DataFrame:
    """Saved activations (not the step's inputs) grouped by shape and dtype, largest total first, in GiB."""
    big = saved[~saved["input"] & (saved["bytes"] >= min_bytes)]
    out = (big.groupby(["shape", "dtype"], sort=False)["bytes"].agg(count="size", total="sum").reset_index()
           .sort_values("total", ascending=False, kind="stable"))
    return out.assign(gib=out["total"] / _GIB).drop(columns="total").reset_index(drop=True)


def partition_row(spec: ModelSpec, preset: str, config: Config | str, *, commit: str | None = None) -> dict:
    """One row of the `partition` table: what `config`'s compiled step saves at `spec`, traced now, by the
    code of `commit` (default: this checkout's now)."""
    config = get_config(config)
    saved = saved_tensors(spec, config)
    act = saved[~saved["input"]]
    largest = [f"{r.count} x {'x'.join(map(str, r.shape[1:]))} {r.dtype}" for r in summary(saved).head(3).itertuples()]
    return {"preset": preset, "shape": "x".join(map(str, spec.shape)), "config": config.name,
            "switches": json.dumps(config.flags, sort_keys=True), "torch": torch.__version__,
            "git_commit": commit or git_commit(), "traced_utc": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "tensors": len(act), "inputs": int(saved["input"].sum()), "activation_bytes": activation_bytes(saved),
            "float32_bytes": int(act.loc[act["dtype"] == "float32", "bytes"].sum()), "largest": "; ".join(largest)}


def record(path: str | os.PathLike, row: dict) -> pd.DataFrame:
    """Put `row` into the partition table at `path` (atomically), replacing the row of the same preset,
    configuration and torch version: each trace is kept as soon as it is done, and a re-run replaces it."""
    new = pd.DataFrame([row])
    try:
        old = schema.read_table(path, "partition")
    except FileNotFoundError:
        old = schema.empty("partition")
    keep = old.merge(new[KEY], on=KEY, how="left", indicator=True)["_merge"].eq("left_only").to_numpy()
    table = pd.concat([old[keep], new], ignore_index=True).sort_values(KEY, kind="stable", ignore_index=True)
    schema.write_table(table, path, "partition")
    return table
