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

from medddpm.measure import convergence as conv
from medddpm.measure import sample_metrics as sm
from medddpm.model.diffusion import GaussianDiffusion
from medddpm.report import convergence as rc
from medddpm.store import convergence as store
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


def test_fixed_noise_makes_configurations_of_one_seed_train_alike(tiny_spec, tmp_path):
    """baseline and opt1 compute the same on a CPU (no TF32 there): from one seed, with fixed noise, their losses
    agree step for step however the global random state stands; without it, the global state decides."""
    data = Pairs(tiny_spec)
    logs = []
    for i, config in enumerate(("baseline", "opt1")):
        torch.manual_seed(100 + i)  # fixed_noise must not depend on it
        train(tiny_spec, config, data, out_dir=tmp_path / config, steps=2, grad_accum=1, seed=5, progress=False,
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


def fake_study(folder: Path, slug: str = "gpu-x", dice: dict | None = None) -> None:
    """A study folder with made-up scores: opt1 the reference, bf16 worse beyond the seeds' spread, fp16 within."""
    dice = dice or {"opt1": [0.80, 0.82, 0.84], "bf16": [0.40, 0.62, 0.64], "fp16": [0.81, 0.79, 0.85]}
    settings = conv.Settings(size=16, steps=10)
    env = {"gpu_name": slug, "torch": "2", "cuda": "", "cudnn": "", "git_commit": "abc"}
    runs, losses, samples = [], [], []
    for config, values in dice.items():
        for seed, value in enumerate(values):
            job = conv.Job(config, seed, settings, "cpu", "", str(folder), env, {}, [])
            runs.append(conv._row(job, skipped_steps=3 if config == "fp16" else 0, final_loss=0.1, ema_decay=0.995,
                                  ema_start=2000, sample_precision="bf16", train_s=1.0, sample_s=1.0))
            losses.append(pd.DataFrame({"config": config, "seed": seed, "step": range(1, 11),
                                        "loss": np.linspace(0.9, 0.1 + value / 10, 10)}))
            for k in range(4):
                source = settings.label_sources[k // 2]
                base = {"config": config, "seed": seed, "sample": k, "label_map": source, "other": -1}
                samples += [base | {"metric": "label_dice", "tissue": t, "value": value} for t in ("csf", "gm", "wm", "mean")]
                samples += [base | {"metric": "hist_w1", "tissue": t, "value": 0.05} for t in ("csf", "gm", "wm", "mean")]
                if k % 2 == 0:
                    samples.append(base | {"other": k + 1, "metric": "ms_ssim", "tissue": "brain", "value": 0.6})
    for k, source in enumerate(settings.label_sources):
        samples.append({"config": "real", "seed": 0, "sample": k, "label_map": source, "other": -1,
                        "metric": "label_dice", "tissue": "mean", "value": 0.85})
    store.write(folder, "runs", pd.DataFrame(runs))
    store.write(folder, "losses", pd.concat(losses, ignore_index=True))
    store.write(folder, "samples", pd.DataFrame(samples))
    image, labels = make_mni_pair(100_000, size=16)
    slices = folder / store.SLICES
    slices.mkdir(parents=True, exist_ok=True)
    (slices / store.slice_file("label", 0)).write_bytes(sm.slices_png(labels, labels=True))
    (slices / store.slice_file("sample", "bf16", 0, 0)).write_bytes(sm.slices_png(image))


def test_the_verdict_counts_a_difference_only_beyond_the_spread_between_seeds(tmp_path):
    fake_study(store.folder(tmp_path, "gpu-x"))
    study = rc.load_study(tmp_path)
    comp = rc.comparison(study).set_index("config")
    assert comp.loc["opt1", "label_dice_verdict"] == "reference" and comp.loc["opt1", "reference"] == "opt1"
    assert comp.loc["bf16", "label_dice_verdict"] == rc.LOSES
    assert comp.loc["fp16", "label_dice_verdict"] == rc.WITHIN
    assert comp.loc["bf16", "failed"] == 1 and comp.loc["opt1", "failed"] == 0  # bf16 seed 0 scored 0.40
    assert comp.loc["fp16", "skipped_steps"] == 9
    spread = max(np.std([0.80, 0.82, 0.84], ddof=1), np.std([0.40, 0.62, 0.64], ddof=1))
    assert comp.loc["bf16", "label_dice_spread"] == pytest.approx(spread)
    text = rc.verdict_text(rc.comparison(study), "gpu-x", {"opt1": 200.0, "bf16": 50.0, "fp16": 60.0})
    assert "**Loses quality**" in text and "`bf16`" in text.split("**Loses quality**")[1].split(".")[0]
    assert "`fp16`" in text.split("Within the spread")[1]
    assert "`bf16` 1 of 3" in text and "not within 0.05" in text
    assert "0.850" in text  # the real images' score


def test_one_seed_gives_no_verdict(tmp_path):
    fake_study(store.folder(tmp_path, "gpu-x"), dice={"opt1": [0.8], "bf16": [0.5]})
    comp = rc.comparison(rc.load_study(tmp_path)).set_index("config")
    assert comp.loc["bf16", "label_dice_verdict"] == rc.ONE_SEED


def test_the_page_s_figures_and_gallery_draw_from_the_tables(tmp_path):
    fake_study(store.folder(tmp_path, "gpu-x"))
    study = rc.load_study(tmp_path)
    binned = rc.loss_curves_binned(study, points=5)
    assert len(binned) == 9 * 5 and binned["step"].max() == 10
    for chart in (rc.loss_chart(study), rc.metrics_chart(study)):
        spec = chart.to_dict()
        assert spec.get("params") or any(layer.get("params") for layer in spec.get("layer", []))
    page = rc.gallery(study, "gpu-x")
    assert page.count("<img") >= 2 and 'alt="A T1 image generated by the bf16 model trained from seed 0' in page
    assert "no image" in page  # the PNGs this fake study lacks are named, not dropped silently
    assert rc.settings(study).loc[0, "optimizer steps"] == "10"
    assert "only begun" in rc.ema_note(study)


def test_a_study_of_another_gpu_in_a_folder_is_an_error(tmp_path):
    fake_study(store.folder(tmp_path, "gpu-x"))
    shutil.move(store.folder(tmp_path, "gpu-x"), tmp_path / "gpu-x" / "elsewhere")
    (tmp_path / "gpu-y").mkdir()
    shutil.move(tmp_path / "gpu-x" / "elsewhere", store.folder(tmp_path, "gpu-y"))
    with pytest.raises(rc.DataError, match="another GPU"):
        rc.load_study(tmp_path)


def test_without_a_study_everything_is_empty(tmp_path):
    study = rc.load_study(tmp_path)
    assert study.empty and rc.comparison(study).empty and rc.per_seed(study).empty
    assert rc.verdict_text(rc.comparison(study), "gpu-x").startswith("No finished run")
    assert rc.gpus_without_study(study, pd.DataFrame({"gpu_slug": ["cpu", "nvidia-h200"]})) == ["nvidia-h200"]
    rc.loss_chart(study).to_dict()
    rc.metrics_chart(study).to_dict()


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


def small_data(tmp_path: Path) -> Path:
    """The committed run tables (what the page's other readers need), without any study."""
    data = tmp_path / "book-data"
    shutil.copytree(REPO / "data", data, ignore=shutil.ignore_patterns(".*", store.CONVERGENCE_DIR))
    return data


@pytest.mark.slow
def test_the_page_says_plainly_that_the_study_has_not_been_run(tmp_path):
    text = execute_page(small_data(tmp_path))
    assert "The study has not been run on `nvidia-h200` yet" in text


@pytest.mark.slow
def test_the_study_end_to_end_at_a_tiny_size_then_the_page(tmp_path):
    out, work = tmp_path / "data", tmp_path / "work"
    settings = conv.Settings(size=16, base_channels=32, steps=3, pairs=2, samples=2, label_maps=1, sample_steps=4)
    tables = conv.study(["baseline", "bf16"], [0, 1], settings, out=out, work=work, device="cpu", progress=False)
    folder = store.folder(out, "cpu")
    for t in store.TABLES:
        schema.read_table(folder / f"{t}.parquet", store.table_name(t))  # on disk, schema-checked
    runs = tables["runs"]
    assert (runs["status"] == "ok").all(), runs["message"].tolist()
    assert sorted(zip(runs["config"], runs["seed"])) == [("baseline", 0), ("baseline", 1), ("bf16", 0), ("bf16", 1)]
    assert (runs["sample_timesteps"] == 4).all() and (runs["skipped_steps"] == 0).all()
    assert (runs["ema_start"] == 2000).all() and set(runs["precision_used"]) == {"fp32", "bf16"}
    losses = tables["losses"]
    assert losses.groupby(["config", "seed"]).size().tolist() == [3] * 4
    first = losses[losses["step"] == 1].set_index(["config", "seed"])["loss"]
    assert first[("baseline", 0)] == pytest.approx(first[("bf16", 0)], rel=0.05), "same weights, data and noise"
    samples = tables["samples"]
    assert set(samples["config"]) == {"baseline", "bf16", "real"}
    assert len(samples[(samples["metric"] == "ms_ssim")]) == 4  # one pair per run
    assert samples.loc[samples["metric"] == "label_dice", "value"].between(0, 1).all()
    assert sorted(p.name for p in (folder / "slices").iterdir()) == sorted(
        [f"{c}-s{s}-{k}.png" for c in ("baseline", "bf16") for s in (0, 1) for k in (0, 1)] + ["label-0.png", "real-0.png"])
    assert not any(work.glob("*/*/checkpoint.pt")), "a finished run's checkpoint is removed"

    # a re-run skips what is done; other settings need another folder
    again = conv.study(["baseline", "bf16"], [0, 1], settings, out=out, work=work, device="cpu", progress=False)
    assert again["runs"]["start_time"].tolist() == runs["start_time"].tolist()
    with pytest.raises(conv.StudyError, match="steps"):
        conv.study(["baseline"], [0], conv.Settings(**{**settings.__dict__, "steps": 4}), out=out, work=work,
                   device="cpu", progress=False)

    data = small_data(tmp_path)
    shutil.copytree(folder, store.folder(data, "cpu"))
    text = execute_page(data)
    assert "The study has not been run on `nvidia-h200` yet" in text
    assert "Reference: `baseline`" in text and 'alt="A T1 image generated by the bf16 model' in text


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
    ({"baseline": [0.80, 0.82, 0.84], "opt1": [0.79, 0.83, 0.81]}, "holds"),  # within the spread between seeds
    ({"baseline": [0.80, 0.82, 0.84], "opt1": [0.70, 0.72, 0.71]}, "fails"),  # below it beyond the spread
    ({"baseline": [0.80, 0.82, 0.84], "opt1": [0.90, 0.55, 0.92]}, "fails"),  # a mean within, but a failed run
    ({"baseline": [0.80], "opt1": [0.81]}, "na"),  # one seed: no spread to weigh against
])
def test_the_tf32_claim_on_the_study_weighs_the_difference_against_the_seeds(tmp_path, dice, verdict):
    from types import SimpleNamespace

    from medddpm.report import claims

    fake_study(store.folder(tmp_path, "gpu-x"), dice=dice)
    v = claims.tf32_samples(SimpleNamespace(study=rc.load_study(tmp_path), slug="gpu-x"))
    assert v.verdict == {"holds": claims.HOLDS, "fails": claims.FAILS, "na": claims.NA}[verdict], v.evidence
    assert claims.tf32_samples(SimpleNamespace(study=None, slug="gpu-x")).verdict == claims.NA
