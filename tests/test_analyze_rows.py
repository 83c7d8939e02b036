"""``pergrad analyze`` on the user's own files: every row scored and named by its row in the
file (npz index, CSV row and id column, image path), label issues with suggested labels, a
corrected copy (``--fix``) that never touches the input, and bad input refused in one line
before anything is trained.

Each data set has labels flipped at known rows of the file; a report that named examples by a
position in an internal split would point at the wrong rows and fail these tests."""

from __future__ import annotations

import contextlib
import csv
import hashlib
import io
import json

import numpy as np

FLIPPED_ROWS = (3, 17, 40, 58, 77, 91, 104, 122, 133, 146)


def _main(*args: str) -> tuple[int, str]:
    """``pergrad ARGS`` in this process: exit code and what it wrote to stderr."""
    from pergrad.cli import main

    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        code = main(list(args))
    return code, err.getvalue()


def _clusters(rows: int = 150, classes: int = 3, seed: int = 0):
    """Well separated Gaussian clusters in 4-D, and the labels with ``FLIPPED_ROWS`` moved to
    the next class."""
    rng = np.random.default_rng(seed)
    clean = np.arange(rows) % classes
    centers = 4.0 * rng.normal(size=(classes, 4))
    x = (centers[clean] + 0.5 * rng.normal(size=(rows, 4))).astype("float32")
    noisy = clean.copy()
    flip = [r for r in FLIPPED_ROWS if r < rows]
    noisy[flip] = (clean[flip] + 1) % classes
    return x, clean.astype("int64"), noisy.astype("int64")


def _classifier(path, inputs, classes: int, rescale: bool = False, softmax: bool = False) -> None:
    import keras

    keras.utils.set_random_seed(0)
    layers = [keras.Input(inputs)] + ([keras.layers.Rescaling(1 / 255)] if rescale else []) \
        + [keras.layers.Flatten(), keras.layers.Dense(16, activation="relu"),
           keras.layers.Dense(classes, activation="softmax" if softmax else None)]
    model = keras.Sequential(layers)
    model.compile(optimizer=keras.optimizers.Adam(1e-2),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=not softmax))
    model.save(path)


def _examples(out) -> list[dict]:
    with open(out / "examples.csv", newline="") as handle:
        return list(csv.DictReader(handle))


def _digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_npz_rows_are_the_rows_of_the_file_and_every_row_is_scored(tmp_path):
    x, _, noisy = _clusters()
    np.savez(tmp_path / "train.npz", x=x, y=noisy)
    _classifier(tmp_path / "model.keras", (4,), 3)
    out = tmp_path / "report"
    code, err = _main("analyze", "--model", str(tmp_path / "model.keras"), "--data",
                      str(tmp_path / "train.npz"), "--epochs", "12", "--batch-size", "16",
                      "--out", str(out))
    assert code == 0, err
    rows = _examples(out)
    assert sorted(int(r["row"]) for r in rows) == list(range(150))  # every row, once
    held_out = [r for r in rows if r["split"] == "validation"]
    assert len(held_out) == 30 and all(r["default"] for r in held_out)
    assert any(int(r["row"]) in FLIPPED_ROWS for r in held_out)  # flips in both parts, found
    top = {int(r["row"]) for r in rows[:len(FLIPPED_ROWS)]}
    assert len(top & set(FLIPPED_ROWS)) >= 9, sorted(top)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rows"] == 150 and summary["held_out_rows"] == 30
    assert {s["row"] for s in summary["most_suspect"][:9]} <= set(FLIPPED_ROWS)
    with open(out / "label_issues.csv", newline="") as handle:
        issues = list(csv.DictReader(handle))
    found = [i for i in issues if int(i["row"]) in FLIPPED_ROWS]
    assert len(found) >= 7 and len(issues) <= len(FLIPPED_ROWS) + 4
    _, clean, _ = _clusters()
    assert all(int(i["suggested"]) == clean[int(i["row"])] for i in found)


def test_csv_rows_and_id_column_name_the_suspects(tmp_path):
    x, _, noisy = _clusters()
    names = np.array(["ash", "birch", "cedar"])
    lines = ["name,f0,species,f1,f2,f3"] + [
        f"tree{r},{x[r, 0]:.5f},{names[noisy[r]]},{x[r, 1]:.5f},{x[r, 2]:.5f},{x[r, 3]:.5f}"
        for r in range(len(x))]
    (tmp_path / "trees.csv").write_text("\n".join(lines) + "\n")
    _classifier(tmp_path / "model.keras", (4,), 3)
    out = tmp_path / "report"
    code, err = _main("analyze", "--model", str(tmp_path / "model.keras"), "--data",
                      str(tmp_path / "trees.csv"), "--label", "species", "--id", "name",
                      "--epochs", "12", "--batch-size", "16", "--test-fraction", "0",
                      "--folds", "0",
                      "--out", str(out))
    assert code == 0, err
    rows = _examples(out)
    assert list(rows[0])[:5] == ["rank", "row", "id", "split", "given"]
    assert all(r["id"] == f"tree{r['row']}" for r in rows)
    assert {r["given"] for r in rows} == set(names)
    top = {int(r["row"]) for r in rows[:len(FLIPPED_ROWS)]}
    assert len(top & set(FLIPPED_ROWS)) >= 9, sorted(top)


def test_image_folder_names_the_mislabeled_files(tmp_path):
    import keras

    rng = np.random.default_rng(3)
    wrong = []
    for name, level in (("dark", 40), ("light", 210)):
        (tmp_path / "images" / name).mkdir(parents=True)
        for k in range(24):
            # Three light images filed as dark: their path must top the report.
            odd = name == "dark" and k in (5, 11, 19)
            pixels = np.clip(rng.normal(210 if odd else level, 20, size=(6, 6, 1)), 0, 255)
            file = tmp_path / "images" / name / f"{k:02d}.png"
            keras.utils.save_img(file, pixels.astype("uint8"), scale=False)
            if odd:
                wrong.append(str(file))
    _classifier(tmp_path / "model.keras", (6, 6, 1), 2, rescale=True)
    out = tmp_path / "report"
    code, err = _main("analyze", "--model", str(tmp_path / "model.keras"), "--data",
                      str(tmp_path / "images"), "--epochs", "10", "--batch-size", "8",
                      "--test-fraction", "0", "--folds", "2", "--out", str(out))
    assert code == 0, err
    rows = _examples(out)
    assert len(rows) == 48 and {r["path"] for r in rows[:3]} == set(wrong)
    # Rows count sorted class folders, then sorted files: dark/05.png is row 5.
    assert {int(r["row"]) for r in rows[:3]} == {5, 11, 19}
    summary = json.loads((out / "summary.json").read_text())
    assert {s["path"] for s in summary["most_suspect"][:3]} == set(wrong)


def test_fix_writes_a_relabelled_copy_and_leaves_the_input_alone(tmp_path):
    x, clean, noisy = _clusters()
    data = tmp_path / "train.npz"
    np.savez(data, x=x, y=noisy)
    before = _digest(data)
    _classifier(tmp_path / "model.keras", (4,), 3)
    out = tmp_path / "report"
    code, err = _main("analyze", "--model", str(tmp_path / "model.keras"), "--data", str(data),
                      "--epochs", "12", "--batch-size", "16", "--folds", "3",
                      "--test-fraction", "0",
                      "--fix", str(tmp_path / "fixed.npz"), "--out", str(out))
    assert code == 0, err
    assert _digest(data) == before
    with open(out / "label_issues.csv", newline="") as handle:
        flagged = {int(i["row"]): int(i["suggested"]) for i in csv.DictReader(handle)}
    with np.load(tmp_path / "fixed.npz") as fixed:
        np.testing.assert_array_equal(fixed["x"], x)
        changed = np.flatnonzero(fixed["y"] != noisy)
        assert set(changed) <= set(flagged)
        assert all(fixed["y"][r] == s for r, s in flagged.items())
        repaired = sum(fixed["y"][r] == clean[r] for r in FLIPPED_ROWS)
    assert repaired >= 8, repaired
    summary = json.loads((out / "summary.json").read_text())
    assert summary["label_issues"]["probabilities"].startswith("out-of-sample (3 folds)")
    assert abs(summary["label_issues"]["estimated_errors"] - len(FLIPPED_ROWS)) <= 4
    assert summary["fixed_copy"] == {"path": str(tmp_path / "fixed.npz"),
                                     "relabelled": len(flagged)}
    scored = _examples(out)
    assert all(r["self_confidence"] and r["oos_margin"] for r in scored)


def test_fix_drop_on_a_csv_keeps_every_other_line(tmp_path):
    x, _, noisy = _clusters()
    lines = ["f0,f1,f2,f3,label"] + [",".join(f"{v:.5f}" for v in x[r]) + f",{noisy[r]}"
                                     for r in range(len(x))]
    table = tmp_path / "t.csv"
    table.write_text("\n".join(lines) + "\n")
    before = _digest(table)
    _classifier(tmp_path / "model.keras", (4,), 3)
    out = tmp_path / "report"
    code, err = _main("analyze", "--model", str(tmp_path / "model.keras"), "--data", str(table),
                      "--label", "label", "--epochs", "12", "--batch-size", "16",
                      "--folds", "2", "--test-fraction", "0",
                      "--fix", str(tmp_path / "kept.csv"), "--drop", "--out", str(out))
    assert code == 0, err
    assert _digest(table) == before
    with open(out / "label_issues.csv", newline="") as handle:
        dropped = {int(i["row"]) for i in csv.DictReader(handle)}
    kept = (tmp_path / "kept.csv").read_text().splitlines()
    assert kept[0] == lines[0]
    assert kept[1:] == [lines[r + 1] for r in range(len(x)) if r not in dropped]
    assert dropped and len(dropped & set(FLIPPED_ROWS)) >= 0.8 * len(dropped)


def _bad_inputs(tmp_path) -> list[tuple[list[str], str]]:
    """(arguments, what the one error line must say) for each refused input."""
    import keras

    _classifier(tmp_path / "m3.keras", (4,), 3)
    _classifier(tmp_path / "img.keras", (6, 6, 1), 2, rescale=True)
    model, img = str(tmp_path / "m3.keras"), str(tmp_path / "img.keras")
    x, _, noisy = _clusters(30)
    header = "a,b,c,d,label\n"
    good = "".join(",".join(f"{v:.3f}" for v in x[r]) + f",{noisy[r]}\n" for r in range(30))
    (tmp_path / "nan.csv").write_text(header + "1,nan,2,3,0\n" + good)
    (tmp_path / "nolabel.csv").write_text(header + good + "1,2,3,4,\n")
    bad = noisy.copy()
    bad[5] = 9
    np.savez(tmp_path / "label9.npz", x=x, y=bad)
    xnan = x.copy()
    xnan[7, 2] = np.nan
    np.savez(tmp_path / "xnan.npz", x=xnan, y=noisy)
    np.savez(tmp_path / "images.npz", x=np.zeros((30, 8, 8, 1), "float32"), y=noisy)
    np.savez(tmp_path / "good.npz", x=x, y=noisy)
    folders = {}
    for name in ("txt", "corrupt"):
        for label in ("a", "b"):
            (tmp_path / name / label).mkdir(parents=True)
            keras.utils.save_img(tmp_path / name / label / "0.png",
                                 np.zeros((6, 6, 1), "uint8"), scale=False)
        folders[name] = str(tmp_path / name)
    (tmp_path / "txt" / "a" / "notes.txt").write_text("not an image")
    (tmp_path / "corrupt" / "b" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n broken")
    probabilities = tmp_path / "probs.keras"
    keras.utils.set_random_seed(0)
    logits = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    logits.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    logits.save(probabilities)
    return [
        (["--model", model, "--data", str(tmp_path / "nan.csv"), "--label", "label"],
         "nan.csv, line 2: column 'b' is not a finite number ('nan')"),
        (["--model", model, "--data", str(tmp_path / "nolabel.csv"), "--label", "label"],
         "nolabel.csv, line 32: the label 'label' is empty"),
        (["--model", model, "--data", str(tmp_path / "label9.npz")],
         "label9.npz, row 5 has label 9, but the model has 3 outputs (labels 0..2)"),
        (["--model", model, "--data", str(tmp_path / "xnan.npz")], "x[7] holds NaN"),
        (["--model", model, "--data", str(tmp_path / "images.npz")],
         "the model takes inputs of shape (None, 4), but"),
        (["--model", img, "--data", folders["txt"]], "notes.txt is not an image"),
        (["--model", img, "--data", folders["corrupt"]], "broken.png is not a readable image"),
        (["--model", str(probabilities), "--data", str(tmp_path / "good.npz")],
         "pass --from-logits"),
        (["--model", model, "--data", str(tmp_path / "good.npz"), "--folds", "20"],
         "20 folds need at least 20 examples of every class"),
        (["--model", model, "--data", str(tmp_path / "good.npz"), "--fix",
          str(tmp_path / "good.npz")], "is the input file"),
        (["--model", model, "--data", str(tmp_path / "good.npz"), "--id", "name"],
         "--id names a column"),
        (["--model", model, "--data", str(tmp_path / "missing.npz")], "no such file"),
        (["--model", model, "--data", str(tmp_path / "good.npz"), "--drop"], "--drop goes with"),
        (["--model", model, "--data", str(tmp_path / "good.npz"), "--fix",
          str(tmp_path / "copy.csv")], "the data is a .npz file; name a .npz copy"),
        (["--model", img, "--data", folders["txt"], "--fix", str(tmp_path / "copy.npz")],
         "for an image folder, move the files listed in label_issues.csv"),
    ]


def test_bad_input_is_one_line_exit_2_and_nothing_is_trained(tmp_path):
    for args, message in _bad_inputs(tmp_path):
        out = tmp_path / "out"
        code, err = _main("analyze", *args, "--out", str(out))
        errors = [line for line in err.splitlines() if line.startswith("pergrad analyze: error:")]
        assert code == 2 and len(errors) == 1 and message in errors[0], (args, err)
        assert not out.exists(), args  # refused before any training or report
