"""The lever list from the counters and the rule that decides a lever (`medddpm.analysis.levers`), on hand-made
tables, and the ranking on the committed tables of best."""

import math

import pandas as pd
import pytest

from medddpm.analysis import levers
from medddpm.store import schema
from medddpm.store.layout import levers_table

from conftest import REPO

H200 = REPO / "data" / "nvidia-h200" / "best"


@pytest.mark.parametrize("name, category, lever", [
    ("triton_poi_fused__to_copy__unsafe_view_add_constant_pad_nd_slice_142", "fused", "padding (constant_pad_nd)"),
    ("triton_poi_fused__to_copy__unsafe_view_add_clone_expand_mul_neg_rsub_sigmoid_sub_view_22", "fused",
     "GroupNorm-SiLU backward"),
    ("triton_poi_fused__to_copy__unsafe_view_add_clone_expand_mul_neg_silu_view_138", "fused",
     "GroupNorm-SiLU forward"),
    ("triton_red_fused__to_copy_permute_var_mean_view_136", "fused", "GroupNorm statistics"),
    ("triton_poi_fused_add_cat_mul_slice_stack_view_134", "fused", "separable upsampling"),
    ("triton_poi_fused__to_copy_convolution_8", "fused", "bias adds and skip concatenations"),
    ("triton_red_fused_convolution_backward_8", "fused", "bias gradients"),
    ("sm90_xmma_wgrad_indexed_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc_nhwc_tilesize64x64x64", "convolution",
     "convolution weight gradient"),
    ("sm80_xmma_fprop_implicit_gemm_indexed_bf16bf16_bf16f32_f32_nhwckrsc_nhwc_tilesize256x64x32", "convolution",
     levers.NARROW_CONVOLUTIONS),
    ("nvjet_sm90_tst_64x384_64x3_1x2_h_bz_coopB_TNT", "gemm", "GEMMs (attention projections, output taps)"),
    # group_norm="triton"'s kernels (medddpm.model.group_norm_triton), and ATen's
    ("_group_norm_stats", "normalization", "GroupNorm statistics"),
    ("_group_norm_silu_apply", "normalization", "GroupNorm-SiLU forward"),
    ("_group_norm_silu_backward_sums", "normalization", "GroupNorm-SiLU backward"),
    ("_group_norm_silu_backward_dx", "normalization", "GroupNorm-SiLU backward"),
    ("void at::native::(anonymous namespace)::RowwiseMomentsCUDAKernel<float>(long, float, float const*, float*, "
     "float*)", "normalization", "GroupNorm statistics"),
    ("void at::native::(anonymous namespace)::GammaBetaBackwardCUDAKernel1<float>(long, long, long)", "normalization",
     "GroupNorm-SiLU backward"),
])
def test_kernels_fall_into_their_levers(name, category, lever):
    assert levers.lever(name, category) == lever


def _steps(rows):
    return pd.DataFrame([{"kernel": k, "key": levers.work_key(k), "category": c, "lever": levers.lever(k, c),
                          "calls": 1.0, "ms": ms} for k, c, ms in rows])


def test_a_kernel_s_roof_is_the_longer_of_its_bytes_and_its_tensor_work():
    """A pointwise kernel of 1 ms moving 2 GB on a 4 TB/s card is at its roof in 0.5 ms (DRAM binds); a
    convolution of 10 ms doing 5 TFLOP on a 1 PFLOP/s card takes 5 ms at the roof (tensor binds); a kernel
    already past the roof saves nothing; one without counters keeps its time and claims no saving."""
    steps = _steps([("triton_poi_fused_silu_1", "fused", 1.0), ("sm90_xmma_fprop_a", "convolution", 10.0),
                    ("triton_poi_fused_add_cat_2", "fused", 0.1), ("triton_poi_fused_other_3", "fused", 2.0)])
    work = pd.DataFrame({"key": ["triton_poi_fused_silu_1", "cuDNN sm90 fprop", "triton_poi_fused_add_cat_2"],
                         "bytes": [2e9, 1e9, 1e9], "flops": [0.0, 5e12, 0.0]})
    rows = levers.roof_rows(steps, work, levers.Roofs(dram=4e12, tensor=1e15, source="test")).set_index("key")
    assert rows.loc["triton_poi_fused_silu_1", "binds"] == "DRAM"
    assert rows.loc["triton_poi_fused_silu_1", "max_saving_ms"] == pytest.approx(0.5)
    assert rows.loc["cuDNN sm90 fprop", "binds"] == "tensor"
    assert rows.loc["cuDNN sm90 fprop", "at_roof_ms"] == pytest.approx(5.0)
    assert rows.loc["triton_poi_fused_add_cat_2", "max_saving_ms"] == 0  # 0.25 ms of bytes in 0.1 ms: at the roof
    assert math.isnan(rows.loc["triton_poi_fused_other_3", "max_saving_ms"])
    ranked = levers.lever_ranking(rows.reset_index()).set_index("lever")
    assert ranked.index[0] == "convolution forward"  # 5 ms to save, the most
    assert ranked.loc["other fused kernels", "uncounted_ms"] == 2.0
    assert ranked.loc["other fused kernels", "max_saving_ms"] == 0.0


def test_the_committed_counters_rank_best_s_levers_on_both_cards():
    """best's H200 counters set against the H200's and the H100's kernel tables: the convolutions come first on
    both, the savings stay below each lever's time, and the H100 (no counters of its own) is ranked from the H200's
    counted work against its own measured roofs."""
    from medddpm.analysis.roofs import card_roofs

    ncu = schema.read_table(H200 / "ncu.parquet")
    h200 = schema.read_table(H200 / "kernels.parquet")
    h100 = schema.read_table(REPO / "data" / "nvidia-h100-80gb-hbm3" / "best" / "kernels.parquet")
    measured = schema.read_table(REPO / "data" / "nvidia-h100-80gb-hbm3" / "roofs.parquet")
    for slug, kernels in (("nvidia-h200", h200), ("nvidia-h100-80gb-hbm3", h100)):
        r = card_roofs(measured, slug, slug)
        rows, ranked = levers.rank_step(kernels, h200, ncu, "nvidia-h200",
                                        levers.Roofs(r["dram"].value, r["bf16"].value, r["bf16"].source))
        assert ranked["lever"].iloc[0].startswith("convolution"), ranked
        assert (ranked["max_saving_ms"] <= ranked["counted_ms"] + 1e-9).all()
        assert ranked["counted_ms"].sum() > 0.8 * ranked["ms"].sum(), "most of the step has counted work"
        pad = ranked.set_index("lever").loc["padding (constant_pad_nd)"]
        assert pad["binds"] == "DRAM" and pad["of_roof"] < 0.3  # the tap sum's strided gather, far from DRAM's roof


def _blocks(rows):
    """(config, block_ms) in call order -> a repeats-like table."""
    return pd.DataFrame([{"config": c, "position": i, "block_ms": ms} for i, (c, ms) in enumerate(rows)])


def test_the_paired_verdict_decides_both_ways_and_abstains_inside_the_spread():
    base = [50.0, 50.3, 49.9, 50.2]
    faster = _blocks([x for b in base for x in (("best", b), ("best+a=true", b - 1.0))] + [("best", 50.1)])
    v = levers.paired_verdict(faster, "best", "best+a=true")
    assert v["verdict"] == "faster" and v["pairs"] == 4 and v["spread_ms"] == pytest.approx(0.4)
    assert v["diff_ms"] == pytest.approx(-1.1, abs=0.11)
    slower = _blocks([x for b in base for x in (("best", b), ("best+a=true", b + 1.0))] + [("best", 50.1)])
    assert levers.paired_verdict(slower, "best", "best+a=true")["verdict"] == "slower"
    close = _blocks([x for b in base for x in (("best", b), ("best+a=true", b - 0.2))] + [("best", 50.1)])
    assert levers.paired_verdict(close, "best", "best+a=true")["verdict"] == "not told apart"
    # one block of best: no spread to judge by
    assert levers.paired_verdict(_blocks([("best", 50.0), ("best+a=true", 40.0)]), "best",
                                 "best+a=true")["verdict"] == "not told apart"


def test_a_drift_of_the_card_cancels_in_the_pairs():
    """The card slows by 0.5 ms a round; the variant is always 0.3 ms faster than the best blocks beside it. The
    variants' own medians are not faster than best's overall median, but each pair is: its neighbours move with
    it. The yardstick (best's neighbouring blocks) is 0.5 ms, so 0.3 ms is not told apart, and 0.7 ms is."""
    rows = []
    for r in range(5):
        rows += [("best", 50 + 0.5 * r), ("best+a=true", 50 + 0.5 * r + 0.25 - 0.3)]
    rows.append(("best", 52.5))
    d = levers.paired_differences(_blocks(rows), "best", "best+a=true")
    assert d.to_numpy() == pytest.approx([-0.3] * 5)
    assert levers.paired_verdict(_blocks(rows), "best", "best+a=true")["verdict"] == "not told apart"
    rows = [(c, ms - 0.4) if c != "best" else (c, ms) for c, ms in rows]
    assert levers.paired_verdict(_blocks(rows), "best", "best+a=true")["verdict"] == "faster"


def _quality(rel_err, loss_diff):
    return pd.DataFrame({"step": [1, 2], "loss": [1.0 + loss_diff, 2.0 * (1 + loss_diff)],
                         "baseline_loss": [1.0, 2.0], "rel_err": rel_err})


def test_parity_holds_within_twice_best_s_and_is_lost_beyond():
    best = _quality(2e-2, 1e-4)
    assert levers.parity_held(_quality(3e-2, 1.5e-4), best)
    assert not levers.parity_held(_quality(5e-2, 1e-4), best), "forward error past twice best's"
    assert not levers.parity_held(_quality(2e-2, 3e-4), best), "losses past twice best's"
    exact = _quality(0.0, 0.0)  # float32 against strict FP32: another order of summation passes, more does not
    assert levers.parity_held(_quality(1.5e-6, 2e-8), exact) and not levers.parity_held(_quality(1e-3, 0.0), exact)
    faster = {"verdict": "faster"}
    assert levers.lever_counts(faster, True)
    assert not levers.lever_counts(faster, False) and not levers.lever_counts(faster, None)
    assert not levers.lever_counts({"verdict": "not told apart"}, True)


def test_lever_tables_round_trip_in_their_places(tmp_path):
    """The call's tables are schema-checked where the data map puts them, and read back as the table their place
    says; a block of another phase or a negative time is refused."""
    from medddpm.report.beyond import lever_call, lever_verdicts

    rows = []
    for i, (c, ms) in enumerate([("best", 50.0), ("best+a=true", 48.0), ("best", 50.2), ("best+a=true", 48.1),
                                 ("best", 50.1)]):
        rows.append({"call_id": "gpu/levers/1", "gpu_slug": "gpu", "gpu_name": "GPU", "config": c, "phase": "train",
                     "batch": 1, "size": 128, "position": i, "repeat": i // 2, "steps": 15, "block_ms": ms,
                     "block_p10_ms": ms - 0.1, "block_p90_ms": ms + 0.1, "peak_mem_bytes": 7, "first_step_s": 1.0,
                     "git_commit": "x", "torch": "2.11", "cudnn": "91900", "start_time": "t"})
    path = levers_table(tmp_path, "gpu", "repeats")
    path.parent.mkdir(parents=True)
    schema.write_table(pd.DataFrame(rows), path, "repeats")
    for c, (err, loss) in {"best": (2e-2, 1e-4), "best+a=true": (2.1e-2, 1e-4)}.items():
        q = levers_table(tmp_path, "gpu", "quality", c)
        q.parent.mkdir(parents=True)
        schema.write_table(_quality(err, loss).assign(run_id=f"gpu/levers/{c}/1"), q, "quality")
    verdicts = lever_verdicts(lever_call(tmp_path)).set_index("config")
    assert verdicts.loc["best+a=true", "verdict"] == "faster" and verdicts.loc["best+a=true", "parity"] == "held"
    assert verdicts.loc["best+a=true", "counts"] and not verdicts.loc["best", "counts"]
    with pytest.raises(schema.SchemaError, match="phase"):
        schema.write_table(pd.DataFrame(rows).assign(phase="warmup"), path, "repeats")
    with pytest.raises(schema.SchemaError, match="block_ms"):
        schema.write_table(pd.DataFrame(rows).assign(block_ms=-1.0), path, "repeats")


def test_seconds_per_volume_over_batches_stop_at_the_first_batch_that_does_not_fit(tmp_path, monkeypatch):
    """A row per batch, each volume's seconds the schedule's steps times the median step over the batch; a batch
    that runs out of memory is recorded and the larger ones are not tried; the table's rows of one call, config
    and batch are replaced on a second write, others kept."""
    import torch

    from medddpm.measure.timing import sampling
    from medddpm.model.unet import ModelSpec

    spec = ModelSpec(size=8, mask_channels=3, base_channels=32, channel_mult=(1, 2), attention_ds=(2,))
    real = sampling._row

    def row(engine, spec, batch, **kw):
        if batch == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(engine, spec, batch, **kw)

    monkeypatch.setattr(sampling, "_row", row)
    rows = sampling.sample_batches(spec, "opt1", [1, 2, 4], device="cpu", warmup=1, steps=2, timesteps=250,
                                   call_id="cpu/levers/1")
    assert rows["batch"].tolist() == [1, 2] and rows["status"].tolist() == ["ok", "oom"]
    ok = rows.iloc[0]
    assert ok["volume_s"] == pytest.approx(250 * ok["step_median_ms"] / 1e3) and ok["steps"] == 2
    assert "out of memory" in rows.iloc[1]["message"] and math.isnan(rows.iloc[1]["volume_s"])
    assert sampling.best_batch(rows)["batch"].tolist() == [1]
    path = tmp_path / "sample_batches.parquet"
    sampling.write_sample_batches(path, rows)
    sampling.write_sample_batches(path, rows.iloc[:1].assign(step_median_ms=1.0))
    back = schema.read_table(path)
    assert len(back) == 2 and back.set_index("batch").loc[1, "step_median_ms"] == 1.0
    for bad in ("2,1", "0,1", "1,x", ""):
        with pytest.raises(ValueError, match="batches must be"):
            sampling.parse_batches(bad)
