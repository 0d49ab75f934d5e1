"""The convergence study: its sample scores, its fixed training noise, its tables, the page's verdict, and (slow)
the whole study at a tiny size and the page built on it."""

import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from medddpm.measure.study import convergence as conv
from medddpm.measure.study import sample_metrics as sm
from medddpm.model.diffusion import GaussianDiffusion
from medddpm.report import convergence as rc
from medddpm.store import convergence as store
from medddpm.store import layout
from medddpm.store import schema
from medddpm.train.synthetic import make_mni_pair
from medddpm.train.loop import read_loss_log, step_noise, train

from conftest import REPO, Pairs


@pytest.fixture(scope="module")
def subject():
    return make_mni_pair(100_000, size=32)


# ------------------------------------------------------------------------------------------- scores


def test_label_dice_is_one_on_an_image_made_from_its_own_label_map(subject):
    _, labels = subject
    image = np.choose(labels, [-1.0, -0.5, 0.2, 0.7])  # background, CSF, GM, WM: T1's order of brightness
    assert sm.label_dice(image, labels) == {"csf": 1.0, "gm": 1.0, "wm": 1.0, "mean": 1.0}
    noisy = image + np.random.default_rng(0).normal(0, 0.05, image.shape)  # clusters still apart
    assert sm.label_dice(noisy, labels)["mean"] > 0.99


def test_label_dice_is_low_on_noise_and_near_the_ceiling_on_a_real_image(subject):
    image, labels = subject
    noise = np.where(labels > 0, np.random.default_rng(1).uniform(-1, 1, labels.shape), -1)
    assert sm.label_dice(noise, labels)["mean"] < 0.4
    assert 0.75 < sm.label_dice(image, labels)["mean"] < 0.95  # partial volumes, bias field, noise
    # a model that swaps grey and white matter puts no tissue in its place
    swapped = np.choose(labels, [-1.0, -0.5, 0.7, 0.2])
    assert sm.label_dice(swapped, labels)["gm"] == 0.0


def test_label_dice_checks_its_inputs():
    with pytest.raises(ValueError, match="shape"):
        sm.label_dice(np.zeros((4, 4, 4)), np.zeros((4, 4, 5), dtype=np.uint8))
    with pytest.raises(ValueError, match="no brain"):
        sm.label_dice(np.zeros((4, 4, 4)), np.zeros((4, 4, 4), dtype=np.uint8))


def test_kmeans_1d_finds_three_separated_groups_deterministically():
    rng = np.random.default_rng(2)
    values = np.concatenate([rng.normal(m, 0.01, 500) for m in (0.7, -0.4, 0.1)])
    cluster, centres = sm.kmeans_1d(values)
    np.testing.assert_allclose(centres, [-0.4, 0.1, 0.7], atol=0.01)
    assert (cluster[:500] == 2).all() and (cluster[500:1000] == 0).all() and (cluster[1000:] == 1).all()
    again, _ = sm.kmeans_1d(values)
    assert (again == cluster).all()


def test_intensity_w1_is_zero_against_itself_and_measures_a_shift(subject):
    image, labels = subject
    ref = sm.tissue_quantiles([image], [labels])
    same = sm.intensity_w1(image, labels, ref)
    assert max(same.values()) < 1e-12
    shifted = sm.intensity_w1(image + 0.1, labels, ref)
    assert all(abs(v - 0.1) < 1e-6 for v in shifted.values())


def test_ms_ssim_is_one_for_a_volume_with_itself_and_low_for_unrelated_noise(subject):
    image, labels = subject
    box = sm.brain_box(labels)
    crop = image[box]
    assert sm.ms_ssim(crop, crop) == pytest.approx(1.0)
    noise = np.random.default_rng(3).uniform(-1, 1, crop.shape)
    assert sm.ms_ssim(crop, noise) < 0.1
    other = np.clip(crop + np.random.default_rng(4).normal(0, 0.1, crop.shape), -1, 1)
    assert 0.1 < sm.ms_ssim(crop, other) < 1.0
    assert sm.ms_ssim(crop, other) == pytest.approx(sm.ms_ssim(other, crop))
    assert sm.ms_ssim(image[:5, :5, :5], image[:5, :5, :5]) == pytest.approx(1.0)  # window shrinks to fit
    with pytest.raises(ValueError):
        sm.ms_ssim(crop, crop[1:])


def test_slices_png_is_a_small_png_of_three_views(subject):
    from PIL import Image
    import io

    image, labels = subject
    for png, mode in ((sm.slices_png(image), "L"), (sm.slices_png(labels, labels=True), "P")):
        assert png.startswith(b"\x89PNG") and len(png) < 10_000
        im = Image.open(io.BytesIO(png))
        assert im.mode == mode and im.size == (3 * 32 + 2 * 2, 32)


def test_score_rows_pass_the_schema(subject):
    image, labels = subject
    images = np.stack([image, np.clip(image + 0.05, -1, 1), image])
    ref = sm.tissue_quantiles([image], [labels])
    rows = conv.score(images, [labels, labels], [0, 0, 1], ref, config="bf16", seed=2,
                      sources=["mni:100000", "mni:100001"])
    schema.validate(rows, "convergence_samples")
    pairs = rows[rows["metric"] == "ms_ssim"]
    assert list(zip(pairs["sample"], pairs["other"])) == [(0, 1)]  # the only two of one label map
    assert set(rows["tissue"]) == {"csf", "gm", "wm", "mean", "brain"}
    assert (rows.loc[rows["metric"] != "ms_ssim", "other"] == -1).all()


def test_labels_of_inverts_the_one_hot_condition(subject):
    from medddpm.train.data import one_hot_condition

    _, labels = subject
    assert (conv.labels_of(one_hot_condition(labels, num_classes=3)) == labels).all()


# -------------------------------------------------------------------------- same weights, data, noise


def test_step_noise_is_a_function_of_seed_step_and_micro_batch():
    a = step_noise((1, 1, 4, 4, 4), 250, 7, 0, seed=3, device=torch.device("cpu"))
    b = step_noise((1, 1, 4, 4, 4), 250, 7, 0, seed=3, device=torch.device("cpu"))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    for other in (step_noise((1, 1, 4, 4, 4), 250, 8, 0, seed=3, device=torch.device("cpu")),
                  step_noise((1, 1, 4, 4, 4), 250, 7, 1, seed=3, device=torch.device("cpu")),
                  step_noise((1, 1, 4, 4, 4), 250, 7, 0, seed=4, device=torch.device("cpu"))):
        assert not torch.equal(a[1], other[1])


def test_fixed_noise_makes_configurations_of_one_seed_train_alike(small_spec, tmp_path):
    """baseline and opt1 compute the same on a CPU (no TF32 there): from one seed, with fixed noise, their losses
    agree step for step however the global random state stands; without it, the global state decides."""
    data = Pairs(small_spec)
    logs = []
    for i, config in enumerate(("baseline", "opt1")):
        torch.manual_seed(100 + i)  # fixed_noise must not depend on it
        train(small_spec, config, data, out_dir=tmp_path / config, steps=2, grad_accum=1, seed=5, progress=False,
              log_every=1, fixed_noise=True)
        logs.append([r["loss"] for r in read_loss_log(tmp_path / config)])
    assert logs[0] == logs[1] and len(logs[0]) == 2


def test_a_respaced_schedule_keeps_the_cumulative_alphas_and_the_model_s_timesteps():
    full = GaussianDiffusion()
    assert full.respaced(full.timesteps) is full
    few = full.respaced(5)
    assert few.timesteps == 5 and few.timestep_map.tolist() == [0, 62, 124, 187, 249]
    ab_full = torch.cumprod(1 - full.betas.double(), 0)
    ab_few = torch.cumprod(1 - few.betas.double(), 0)
    torch.testing.assert_close(ab_few, ab_full[few.timestep_map], rtol=1e-5, atol=1e-7)
    seen = []

    def model(x, t):
        seen.append(int(t[0]))
        return torch.zeros_like(x[:, :1])

    few.sample(model, torch.zeros(1, 3, 4, 4, 4), progress=False, generator=torch.Generator().manual_seed(0))
    assert seen == [249, 187, 124, 62, 0]
    with pytest.raises(ValueError):
        full.respaced(251)


# ---------------------------------------------------------------------------------------- settings


def test_settings_are_checked_before_any_work():
    with pytest.raises(conv.StudyError, match="spread evenly"):
        conv.Settings(samples=3, label_maps=2)
    with pytest.raises(conv.StudyError, match="embedded data"):
        conv.Settings(data="/some/folder")
    with pytest.raises(conv.StudyError, match="at most"):
        conv.Settings(sample_steps=500)
    with pytest.raises(ValueError):
        conv.Settings(size=66)  # not divisible by the U-Net's levels
    with pytest.raises(conv.StudyError, match="distinct"):
        conv.study(["bf16", "bf16"], [0])
    assert conv.Settings().label_sources == ["mni:100000", "mni:100001"] and conv.Settings().per_map == 2


def test_store_names_and_tables(tmp_path):
    assert store.run_name("best+tap_gemm=false", 2) == "best_tap_gemm_false-s2"
    assert store.slice_file("sample", "bf16", 1, 3) == "bf16-s1-3.png" and store.slice_file("real", 0) == "real-0.png"
    assert store.table_name(tmp_path / "losses.parquet") == "convergence_losses"
    with pytest.raises(schema.SchemaError):
        store.table_name(tmp_path / "steps.parquet")
    assert store.read(tmp_path, "runs").empty
    df = pd.DataFrame({"config": ["bf16"], "seed": [0], "step": [1], "loss": [0.5]})
    store.write(tmp_path, "losses", df)
    assert store.read(tmp_path, "losses").equals(df)
    with pytest.raises(schema.SchemaError):
        store.write(tmp_path, "losses", df.assign(extra=1))


def test_old_run_tables_read_with_no_skipped_steps():
    old = sorted((REPO / "data").glob("*/*/run.parquet"))[0]
    assert schema.read_table(old, "run")["skipped_steps"].tolist() == [0]


def test_the_command_line_parses_seeds():
    from medddpm.cli.args import seeds_arg

    assert seeds_arg("3") == [0, 1, 2] and seeds_arg("0,4,7") == [0, 4, 7] and seeds_arg("5,") == [5]
    import argparse

    for bad in ("0", "1,1", "-1,2", "x"):
        with pytest.raises(argparse.ArgumentTypeError):
            seeds_arg(bad)


# -------------------------------------------------------------------------------------- the page


def fake_study(folder: Path, slug: str = "gpu-x", dice: dict | None = None, w1: dict | None = None,
               ssim: dict | None = None, diverged: dict | None = None) -> None:
    """A study folder with made-up per-seed scores: `dice`, `w1` and `ssim` map a configuration to one value per
    seed (hist_w1 0.05 and MS-SSIM 0.6 where not given); `diverged` maps a configuration to the seeds whose run
    diverged (no samples)."""
    dice = dice or {"opt1": [0.80, 0.82, 0.84], "bf16": [0.40, 0.62, 0.64], "fp16": [0.81, 0.79, 0.85]}
    w1, ssim, diverged = w1 or {}, ssim or {}, diverged or {}
    settings = conv.Settings(size=16, steps=10)
    env = {"gpu_name": slug, "torch": "2", "cuda": "", "cudnn": "", "git_commit": "abc"}
    runs, losses, samples = [], [], []
    for config, values in dice.items():
        for seed, value in enumerate(values):
            job = conv.Job(config, seed, settings, "cpu", "", str(folder), env, {}, [])
            bad = seed in diverged.get(config, ())
            runs.append(conv._row(job, skipped_steps=3 if config == "fp16" else 0, final_loss=0.1, ema_decay=0.995,
                                  ema_start=2000, sample_precision="bf16", train_s=1.0, sample_s=1.0,
                                  **({"status": "diverged", "message": "training diverged: loss nan at step 4"}
                                     if bad else {})))
            losses.append(pd.DataFrame({"config": config, "seed": seed, "step": range(1, 11),
                                        "loss": np.linspace(0.9, 0.1 + value / 10, 10)}))
            if bad:
                continue
            for k in range(4):
                source = settings.label_sources[k // 2]
                base = {"config": config, "seed": seed, "sample": k, "label_map": source, "other": -1}
                samples += [base | {"metric": "label_dice", "tissue": t, "value": value} for t in ("csf", "gm", "wm", "mean")]
                samples += [base | {"metric": "hist_w1", "tissue": t, "value": w1.get(config, [0.05] * 99)[seed]}
                            for t in ("csf", "gm", "wm", "mean")]
                if k % 2 == 0:
                    samples.append(base | {"other": k + 1, "metric": "ms_ssim", "tissue": "brain",
                                           "value": ssim.get(config, [0.6] * 99)[seed]})
    for k, source in enumerate(settings.label_sources):
        samples.append({"config": "real", "seed": 0, "sample": k, "label_map": source, "other": -1,
                        "metric": "label_dice", "tissue": "mean", "value": 0.85})
    store.write(folder, "runs", pd.DataFrame(runs))
    store.write(folder, "losses", pd.concat(losses, ignore_index=True))
    store.write(folder, "samples", pd.DataFrame(samples))
    image, labels = make_mni_pair(100_000, size=16)
    slices = folder / layout.SLICES_DIR
    slices.mkdir(parents=True, exist_ok=True)
    (slices / store.slice_file("label", 0)).write_bytes(sm.slices_png(labels, labels=True))
    (slices / store.slice_file("sample", "bf16", 0, 0)).write_bytes(sm.slices_png(image))


# the reference's label_dice per seed; candidates below are made from it, seed by seed
REF = [0.70, 0.80, 0.75, 0.85, 0.78]


def paired_of(tmp_path, cand: dict, **kw) -> pd.DataFrame:
    """Each candidate's verdict against opt1, the reference."""
    fake_study(layout.convergence_folder(tmp_path, "gpu-x"), dice={"opt1": REF, **cand}, **kw)
    v = rc.verdicts(rc.load_study(tmp_path))
    return v[v["reference"] == "opt1"].set_index("candidate")


def test_the_equivalence_rule_comes_out_each_way():
    from medddpm.report import equivalence as eq

    assert eq.judge([0.01, -0.01, 0.0, 0.005, -0.004], 0.05).verdict == eq.EQUIVALENT
    assert eq.judge([-0.10, -0.11, -0.09, -0.12, -0.10], 0.05).verdict == eq.WORSE
    assert eq.judge([0.10, 0.11, 0.09, 0.12, 0.10], 0.05).verdict == eq.BETTER
    # lower is better: a rise in distance is the losing side
    assert eq.judge([0.10, 0.11, 0.09, 0.12, 0.10], 0.05, higher_is_better=False).verdict == eq.WORSE
    wide = eq.judge([0.08, -0.07, 0.05, -0.06, 0.02], 0.05)
    assert wide.verdict == eq.UNDECIDED and wide.seeds_needed > 5
    # the seeds it asks for would decide it at the same spread: the interval then fits inside the margin
    assert eq.half_width(wide.sd, wide.seeds_needed) < 0.05 - abs(wide.mean)
    assert eq.half_width(wide.sd, wide.seeds_needed - 1) >= 0.05 - abs(wide.mean)
    assert eq.judge([0.05, 0.05], 0.05).seeds_needed is None  # a mean on the margin: no number of seeds decides
    assert eq.judge([0.01], 0.05).verdict == eq.UNDECIDED  # one seed: no spread
    j = eq.judge([0.01, 0.03, 0.02], 0.05)
    assert j.low < j.mean < j.high and j.high - j.mean == pytest.approx(2.920 * 0.01 / 3 ** 0.5, rel=1e-3)  # t(0.95, 2 df)
    with pytest.raises(ValueError, match="margin"):
        eq.judge([0.1, 0.2], 0)


def test_paired_verdicts_take_differences_seed_by_seed(tmp_path):
    """bf16 is worse by 0.1 on every seed, a shift far smaller than the reference's spread between seeds (sd 0.06):
    unpaired, it would sit within the spread; paired, it is clearly worse. fp16 follows opt1 within 0.01."""
    v = paired_of(tmp_path, {"bf16": [d - 0.1 for d in REF], "fp16": [d + 0.01 * (-1) ** i for i, d in enumerate(REF)]})
    assert v.loc["bf16", "verdict"] == "worse" and v.loc["bf16", "label_dice_verdict"] == "worse"
    assert v.loc["fp16", "verdict"] == "equivalent" and v.loc["fp16", "seeds"] == 5
    p = rc.paired(rc.load_study(tmp_path)).set_index(["candidate", "reference", "metric"]).sort_index()
    assert p.loc[("bf16", "opt1", "label_dice"), "mean"] == pytest.approx(-0.1)
    assert p.loc[("bf16", "opt1", "label_dice"), "sd"] == pytest.approx(0, abs=1e-9)
    assert set(p.loc[("fp16", "opt1")]["verdict"]) == {"equivalent"}  # hist_w1 and MS-SSIM the same on every seed
    assert p.loc[("fp16", "bf16", "label_dice"), "verdict"] == "better"  # fp16 against bf16 too


def test_a_worse_intensity_or_a_collapse_makes_a_comparison_worse(tmp_path):
    v = paired_of(tmp_path, {"bf16": REF, "fp16": REF}, w1={"bf16": [0.15] * 5},
                  ssim={"fp16": [0.9] * 5})
    assert v.loc["bf16", "verdict"] == "worse" and v.loc["bf16", "hist_w1_verdict"] == "worse"
    assert v.loc["bf16", "label_dice_verdict"] == "equivalent"
    assert v.loc["fp16", "ms_ssim_verdict"] == "worse"  # samples of one map alike: less varied


def test_undecided_says_how_many_seeds_would_decide(tmp_path):
    noisy = [d + x for d, x in zip(REF, (0.08, -0.07, 0.05, -0.06, 0.02))]
    v = paired_of(tmp_path, {"bf16": noisy})
    assert v.loc["bf16", "verdict"] == "undecided"
    text = rc.verdict_text(rc.load_study(tmp_path), "gpu-x")
    assert "`bf16` is **undecided** against `opt1`" in text and "seeds would decide" in text


def test_a_candidate_better_on_every_score_is_better(tmp_path):
    v = paired_of(tmp_path, {"bf16": [d + 0.1 for d in REF]})
    assert v.loc["bf16", "verdict"] == "better"


def test_a_diverged_run_counts_as_a_failure_and_leaves_its_pair_out(tmp_path):
    v = paired_of(tmp_path, {"fp16": REF}, diverged={"fp16": [2]})
    assert v.loc["fp16", "verdict"] == "worse"  # the same scores where it finished, but one more failed run
    assert v.loc["fp16", "candidate_failed"] == 1 and v.loc["fp16", "reference_failed"] == 0
    assert v.loc["fp16", "seeds"] == 4
    sc = rc.scores(rc.load_study(tmp_path)).set_index("config")
    assert sc.loc["fp16", "failed"] == 1 and sc.loc["fp16", "seeds"] == 4
    assert "Failed runs" in rc.verdict_text(rc.load_study(tmp_path), "gpu-x")


def test_the_verdict_text_and_the_first_page_s_summary(tmp_path):
    fake_study(layout.convergence_folder(tmp_path, "gpu-x"))
    study = rc.load_study(tmp_path)
    text = rc.verdict_text(study, "gpu-x", {"opt1": 200.0, "bf16": 50.0, "fp16": 60.0})
    assert "real images score a mean label_dice of 0.850" in text
    assert "`bf16` is **worse** than `opt1`" in text  # seed 0 scored 0.40: a failed run
    assert "`bf16` 1 of 3" in text and "The fastest configuration measured on this device is `bf16`" in text
    head = rc.headline_text(study)
    assert head.startswith("- **gpu-x**:") and "`fp16` against `opt1`" in head


def test_one_seed_gives_no_interval(tmp_path):
    fake_study(layout.convergence_folder(tmp_path, "gpu-x"), dice={"opt1": [0.8], "bf16": [0.5]})
    p = rc.paired(rc.load_study(tmp_path))
    assert (p["verdict"] == "undecided").all() and p["low"].isna().all()


def test_the_page_s_figures_and_gallery_draw_from_the_tables(tmp_path):
    fake_study(layout.convergence_folder(tmp_path, "gpu-x"))
    study = rc.load_study(tmp_path)
    binned = rc.loss_curves_binned(study, points=5)
    assert len(binned) == 9 * 5 and binned["step"].max() == 10
    bands = rc.loss_bands(study, points=5)
    assert len(bands) == 3 * 5 and (bands["low"] <= bands["median"]).all() and (bands["median"] <= bands["high"]).all()
    assert (bands["seeds"] == 3).all()
    for chart in (rc.loss_chart(study), rc.metrics_chart(study), rc.paired_chart(study)):
        spec = chart.to_dict()
        assert spec.get("params") or any(layer.get("params") for layer in spec.get("layer", []))
    page = rc.gallery(study, "gpu-x")
    assert page.count("<img") >= 2 and 'alt="A T1 image generated by the bf16 model trained from seed 0' in page
    assert "no image" in page  # the PNGs this fake study lacks are named, not dropped silently
    assert rc.settings(study).loc[0, "optimizer steps"] == "10"
    assert "only begun" in rc.ema_note(study)


def test_a_study_of_another_gpu_in_a_folder_is_an_error(tmp_path):
    fake_study(layout.convergence_folder(tmp_path, "gpu-x"))
    shutil.move(layout.convergence_folder(tmp_path, "gpu-x"), tmp_path / "gpu-x" / "elsewhere")
    (tmp_path / "gpu-y").mkdir()
    shutil.move(tmp_path / "gpu-x" / "elsewhere", layout.convergence_folder(tmp_path, "gpu-y"))
    with pytest.raises(rc.DataError, match="another GPU"):
        rc.load_study(tmp_path)


def test_without_a_study_everything_is_empty(tmp_path):
    study = rc.load_study(tmp_path)
    assert study.empty and rc.scores(study).empty and rc.per_seed(study).empty and rc.paired(study).empty
    assert rc.verdict_text(study, "gpu-x").startswith("No finished run") and rc.headline_text(study) == ""
    assert rc.gpus_without_study(study, pd.DataFrame({"gpu_slug": ["cpu", "nvidia-h200"]})) == ["nvidia-h200"]
    for chart in (rc.loss_chart(study), rc.metrics_chart(study), rc.paired_chart(study)):
        chart.to_dict()


# --------------------------------------------------------------------------------------- slow: runs


def execute_page(data: Path) -> str:
    """book/convergence.md executed as a notebook on `data`; its Markdown and HTML outputs, joined."""
    import jupytext
    import nbclient

    nb = jupytext.read(REPO / "book" / "convergence.md")
    env = dict(os.environ, MEDDDPM_DATA=str(data), PYTHONPATH=str(REPO))
    old = dict(os.environ)
    os.environ.update(env)
    try:
        nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                resources={"metadata": {"path": str(REPO / "book")}}).execute()
    finally:
        os.environ.clear()
        os.environ.update(old)
    out = []
    for cell in nb.cells:
        for o in cell.get("outputs", []):
            out += [o.get("data", {}).get(k, "") for k in ("text/markdown", "text/html")]
    return "\n".join(out)


# The GPUs of the committed run tables, as the page names those without a study
MEASURED_GPUS = " or ".join(f"`{p.name}`" for p in sorted((REPO / "data").glob("nvidia-*")) if p.is_dir())


def small_data(tmp_path: Path) -> Path:
    """The committed run tables (what the page's other readers need), without any study."""
    data = tmp_path / "book-data"
    shutil.copytree(REPO / "data", data, ignore=shutil.ignore_patterns(".*", layout.CONVERGENCE_DIR))
    return data


@pytest.mark.slow
def test_the_page_says_plainly_that_the_study_has_not_been_run(tmp_path):
    text = execute_page(small_data(tmp_path))
    assert f"The study has not been run on {MEASURED_GPUS} yet" in text


@pytest.mark.slow
def test_the_study_end_to_end_at_a_tiny_size_then_the_page(tmp_path):
    """opt1 and bf16, two seeds each, at 8^3 (a bf16 run took 150 s at 16^3 on an AVX2-only CPU, 9 s at 8^3)."""
    out, work = tmp_path / "data", tmp_path / "work"
    settings = conv.Settings(size=8, base_channels=32, steps=3, pairs=2, samples=2, label_maps=1, sample_steps=4)
    tables = conv.study(["opt1", "bf16"], [0, 1], settings, out=out, work=work, device="cpu", progress=False)
    folder = layout.convergence_folder(out, "cpu")
    for t in layout.CONVERGENCE_TABLES:
        schema.read_table(folder / f"{t}.parquet", store.table_name(t))  # on disk, schema-checked
    runs = tables["runs"]
    assert (runs["status"] == "ok").all(), runs["message"].tolist()
    assert sorted(zip(runs["config"], runs["seed"])) == [("bf16", 0), ("bf16", 1), ("opt1", 0), ("opt1", 1)]
    assert (runs["sample_steps"] == 4).all() and (runs["skipped_steps"] == 0).all()
    assert (runs["ema_start"] == 2000).all() and set(runs["precision_used"]) == {"fp32", "bf16"}
    losses = tables["losses"]
    assert losses.groupby(["config", "seed"]).size().tolist() == [3] * 4
    first = losses[losses["step"] == 1].set_index(["config", "seed"])["loss"]
    assert first[("opt1", 0)] == pytest.approx(first[("bf16", 0)], rel=0.05), "same weights, data and noise"
    samples = tables["samples"]
    assert set(samples["config"]) == {"opt1", "bf16", "real"}
    assert len(samples[(samples["metric"] == "ms_ssim")]) == 4  # one pair per run
    assert samples.loc[samples["metric"] == "label_dice", "value"].between(0, 1).all()
    assert sorted(p.name for p in (folder / "slices").iterdir()) == sorted(
        [f"{c}-s{s}-{k}.png" for c in ("opt1", "bf16") for s in (0, 1) for k in (0, 1)] + ["label-0.png", "real-0.png"])
    assert not any(work.glob("*/*/checkpoint.pt")), "a finished run's checkpoint is removed"

    # a re-run skips what is done; other settings need another folder
    again = conv.study(["opt1", "bf16"], [0, 1], settings, out=out, work=work, device="cpu", progress=False)
    assert again["runs"]["start_time"].tolist() == runs["start_time"].tolist()
    with pytest.raises(conv.StudyError, match="steps"):
        conv.study(["opt1"], [0], conv.Settings(**{**settings.__dict__, "steps": 4}), out=out, work=work,
                   device="cpu", progress=False)

    data = small_data(tmp_path)
    shutil.copytree(folder, layout.convergence_folder(data, "cpu"))
    text = execute_page(data)
    assert f"The study has not been run on {MEASURED_GPUS} yet" in text
    assert "`bf16` is **" in text and "`opt1` over 2 paired seeds" in text  # the paired verdict
    assert 'alt="A T1 image generated by the bf16 model' in text


@pytest.mark.slow
def test_parallel_runs_resume_after_the_time_limit_and_fp16_records_its_skipped_steps(tmp_path):
    """fp16 at 8^3 (PyTorch's CPU runs fp16 3D convolutions in a reference kernel); two runs in worker processes.
    A time limit that stops both leaves no row; the same command then finishes them."""
    out, work = tmp_path / "data", tmp_path / "work"
    settings = conv.Settings(size=8, base_channels=32, steps=2, pairs=2, samples=2, label_maps=1, sample_steps=2)
    stopped = conv.study(["fp16"], [0, 1], settings, out=out, work=work, device="cpu", jobs=2, time_limit=1,
                         progress=False)
    assert stopped["runs"].empty
    tables = conv.study(["fp16"], [0, 1], settings, out=out, work=work, device="cpu", jobs=2, progress=False)
    runs = tables["runs"]
    assert (runs["status"] == "ok").all(), runs["message"].tolist()
    assert set(runs["precision_used"]) == {"fp16"} and (runs["skipped_steps"] >= 0).all()
    assert set(runs["sample_precision"]) == {"fp16"}


@pytest.mark.parametrize("dice, verdict", [
    ({"baseline": REF, "opt1": [d + 0.01 * (-1) ** i for i, d in enumerate(REF)]}, "holds"),  # equivalent
    ({"baseline": REF, "opt1": [d - 0.1 for d in REF]}, "fails"),  # worse on every seed
    ({"baseline": REF, "opt1": [d + x for d, x in zip(REF, (0.08, -0.07, 0.05, -0.06, 0.02))]}, "undecided"),
    ({"baseline": [0.80], "opt1": [0.81]}, "undecided"),  # one seed: no interval
    ({"opt1": [0.80]}, "na"),  # no strict-FP32 run to pair with
])
def test_the_tf32_claim_is_the_study_s_paired_verdict(tmp_path, dice, verdict):
    from types import SimpleNamespace

    from medddpm.report import claims

    fake_study(layout.convergence_folder(tmp_path, "gpu-x"), dice=dice)
    v = claims.tf32_samples(SimpleNamespace(study=rc.load_study(tmp_path), slug="gpu-x"))
    assert v.verdict == {"holds": claims.HOLDS, "fails": claims.FAILS, "undecided": claims.UNDECIDED,
                         "na": claims.NA}[verdict], v.evidence
    assert claims.tf32_samples(SimpleNamespace(study=None, slug="gpu-x")).verdict == claims.NA
