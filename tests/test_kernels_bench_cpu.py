"""benchmarks/kernels.py on CPU: the FP8 sections' smoke runs in slices
(--part) written as one run's results by --merge, in a copy of benchmarks/
(the repository's results stay as they are)."""

import json
import os
import pathlib
import shutil
import subprocess
import sys


def _bench_copy(tmp_path):
    """(a copy of benchmarks/ in tmp_path, run(*args): kernels.py there)."""
    bench = tmp_path / "benchmarks"
    shutil.copytree(pathlib.Path(__file__).resolve().parents[1] / "benchmarks", bench)
    run = lambda *a: subprocess.run([sys.executable, "kernels.py", *a], cwd=bench,
                                    capture_output=True, text=True, timeout=600,
                                    env=dict(os.environ))
    return bench, run


def test_part_and_merge_write_one_section(tmp_path):
    bench, run = _bench_copy(tmp_path)
    part = tmp_path / "part.json"
    proc = run("--only", "fp8", "--smoke", "--part", "1/1", "--part-out", str(part))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(part.read_text())["rows"]
    assert {r["implementation"] for r in rows} >= {"pk_fp8_tensor", "pk_fp8_block",
                                                  "xla_fp8_direct"}
    # The merge names the machine and commit that timed the rows (the part's),
    # not its own; parts of two machines are not one run.
    data = json.loads(part.read_text())
    assert data["measured"]["machine"]["platform"] == "cpu"
    data["measured"] = {"machine": {"gpu_model": "Fake GPU", "gpu_count": 1, "platform": "gpu",
                                    "jax": "0.0.1"}, "commit": "abc1234"}
    part.write_text(json.dumps(data))
    other = tmp_path / "other.json"
    other.write_text(json.dumps({**data, "measured": {**data["measured"], "commit": "def5678"}}))
    proc = run("--merge", str(part), str(other))
    assert proc.returncode != 0 and "not one run" in proc.stderr
    proc = run("--merge", str(part), str(part))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    written = json.loads((bench / "results" / "kernels_fp8.json").read_text())
    assert len(written) == 2 * len(rows)
    assert {(r["gpu_model"], r["commit"]) for r in written} == {("Fake GPU", "abc1234")}
    text = (bench / "RESULTS.md").read_text()
    section = text[text.index("<!-- kernels_fp8:begin -->"):text.index("<!-- kernels_fp8:end -->")]
    assert "1 x Fake GPU, jax 0.0.1, commit abc1234." in section
    assert "--part I/N (I = 1..2), then --merge" in section
    assert section.count("| fp8_gemm_tensor |") == 2 * sum(
        r["op"] == "fp8_gemm_tensor" for r in rows)


def test_skipped_implementations_are_absent_and_named(tmp_path):
    """--skip drops attention implementations from every row, and the merged
    section's command names the parts' arguments (--skip included)."""
    bench, run = _bench_copy(tmp_path)
    part = tmp_path / "part.json"
    proc = run("--only", "attention", "--smoke", "--skip", "pk_kernel_cudnn_bwd",
               "--part", "1/1", "--part-out", str(part))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    impls = {r["implementation"] for r in json.loads(part.read_text())["rows"]}
    assert {"pk", "pk_kernel"} <= impls and "pk_kernel_cudnn_bwd" not in impls
    proc = run("--merge", str(part))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text = (bench / "RESULTS.md").read_text()
    section = text[text.index("<!-- kernels_attention:begin -->"):
                   text.index("<!-- kernels_attention:end -->")]
    assert ("kernels.py --only attention --smoke --skip pk_kernel_cudnn_bwd --part I/N "
            "(I = 1..1), then --merge") in section


def test_fp8_train_rows_land_in_their_own_section(tmp_path):
    """The fp8_train smoke run: every implementation's training step (pk's
    recipes, the TP op at world size 1, bf16, XLA's FP8 dot, Flax's FP8 ops)
    checked against bf16's and timed; its rows written to
    kernels_fp8_train.json and its RESULTS.md section, none to kernels_fp8's."""
    bench, run = _bench_copy(tmp_path)
    part = tmp_path / "part.json"
    proc = run("--only", "fp8_train", "--smoke", "--part", "1/1", "--part-out", str(part))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(part.read_text())["rows"]
    assert {r["implementation"] for r in rows} >= {
        "pk_fp8_current", "pk_fp8_delayed", "pk_fp8_block", "pk_tp_fp8_current",
        "pk_tp_fp8_block", "xla_bf16", "xla_fp8_current", "flax_fp8_xla"}
    assert {r["op"] for r in rows} == {"fp8_train"}
    assert {r["recipe"] for r in rows} == {"current", "delayed", "block"}
    assert all({"m", "k", "n", "median_ms", "best_other", "best_other_ms"} <= set(r)
               for r in rows)
    before = (bench / "results" / "kernels_fp8.json").read_text()
    proc = run("--merge", str(part))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    written = json.loads((bench / "results" / "kernels_fp8_train.json").read_text())
    key = lambda r: (r["implementation"], r["recipe"], r["median_ms"])
    assert sorted(map(key, written)) == sorted(map(key, rows))
    assert (bench / "results" / "kernels_fp8.json").read_text() == before
    assert "<!-- kernels_fp8_train:begin -->" in (bench / "RESULTS.md").read_text()


def test_results_name_the_measured_builds_commit(monkeypatch):
    """benchmarks/common.commit(): an installed build (pk_jax outside this
    checkout, a wheel) is named by the commit its build recorded, not by the
    checkout's; $PK_BENCH_COMMIT overrides both."""
    import types

    import pk_jax
    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
    import common
    monkeypatch.delenv("PK_BENCH_COMMIT", raising=False)
    fake = types.ModuleType("pk_jax._build_info")
    fake.commit = "abc1234"
    monkeypatch.setitem(sys.modules, "pk_jax._build_info", fake)
    monkeypatch.setattr(pk_jax, "_build_info", fake, raising=False)
    monkeypatch.setattr(pk_jax, "__file__", "/opt/site-packages/pk_jax/__init__.py")
    assert common.commit() == "abc1234"
    fake.commit = ""  # a build that recorded none: unknown, not the checkout's
    assert common.commit() is None
    monkeypatch.setenv("PK_BENCH_COMMIT", "0123abc")
    assert common.commit() == "0123abc"


def test_interleaved_rounds_start_apart(monkeypatch):
    """benchmarks/common.interleaved_ms: each round starts further down the
    list, so no implementation is first in two rounds (rounds <= count),
    and every one is timed once a round."""
    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
    import common
    order = []
    monkeypatch.setattr(common, "time_ms", lambda fn, **kw: fn())
    fns = {name: (lambda name=name: order.append(name) or 1.0) for name in "abcdef"}
    runs = common.interleaved_ms(fns, rounds=3)
    assert {name: len(t) for name, t in runs.items()} == dict.fromkeys("abcdef", 3)
    firsts = [order[i * 6] for i in range(3)]
    assert firsts == ["a", "c", "e"]
    for i in range(3):
        assert sorted(order[i * 6:(i + 1) * 6]) == list("abcdef")
    order.clear()
    common.interleaved_ms({"x": lambda: order.append("x") or 1.0}, rounds=3)
    assert order == ["x"] * 3


def test_merged_command_rewrites_only_the_slice(monkeypatch):
    """The merged section's command: --part's value becomes I/N (either
    spelling), --part-out and its file go, other arguments stay as typed (a
    --match text like 32/4 included)."""
    bench = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"
    monkeypatch.syspath_prepend(str(bench))
    import kernels
    args = kernels._parts_arguments
    assert args(["--only", "attention", "--match", "32/4", "--part", "2/3", "--part-out",
                 "p.json"]) == "--only attention --match 32/4 --part I/N"
    assert args(["--part=1/2", "--part-out=p.json", "--rounds", "7"]) == "--part=I/N --rounds 7"
