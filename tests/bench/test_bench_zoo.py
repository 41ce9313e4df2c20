"""``python -m bench zoo`` runs the zoo's checks end to end and stores a row per family and dtype."""

import json
import pathlib

import forked

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_zoo_benchmark_smoke_writes_a_row_per_family_and_dtype(tmp_path):
    completed = forked.run_python(["-m", "bench", "zoo", "--smoke", "--families", "llama", "--dtypes", "float32",
                                   "--out", str(tmp_path)], cwd=REPO, check=True)
    [path] = tmp_path.glob("zoo-*.json")
    result = json.loads(path.read_text())
    assert result["workload"] == "zoo" and result["complete"] and result["targets"] == []
    [row] = result["rows"]
    assert (row["family"], row["dtype"], row["status"], row["keep_all_bit_exact"]) == ("llama", "float32", "pass", True)
    assert row["sites_rewritten"] == 8 and row["fp8_sqnr_db"] > 20
    assert "| llama | float32 | 8 / 0 | yes |" in completed.stdout


def test_zoo_benchmark_refuses_an_unknown_family(tmp_path):
    completed = forked.run_python(["-m", "bench", "zoo", "--families", "qwen3_next", "--out", str(tmp_path)],
                                  cwd=REPO)
    assert completed.returncode != 0 and "gated delta rule" in completed.stderr
    assert not list(tmp_path.glob("*.json"))
