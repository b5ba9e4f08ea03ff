"""The README's results table is generated from the committed study reports: it regenerates byte
for byte, reads comparison.json (with the sharpened-base verdicts) before comparison.md, and
refuses what it cannot read."""

import json
import pathlib
import shutil

import pytest

from jaxagent.eval import results_table
from launch import results_table as launcher

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_readme_block_regenerates_byte_identically():
  readme = (ROOT / "README.md").read_text(encoding="utf-8")
  block = results_table.render(ROOT)
  assert block in readme, "README.md's results table is stale: run python -m launch.results_table"
  assert results_table.replace_block(readme, block) == readme
  assert launcher.main(["--check"]) == 0


def _claims(verdicts, sharpened=None):
  return {"claims": {str(n): {"verdict": v, **({"sharpened": {"verdict": sharpened[n - 1]}}
                                               if sharpened else {})}
                     for n, v in enumerate(verdicts, 1)}}


def test_rows_from_json_first_then_markdown(tmp_path):
  res = tmp_path / "docs" / "results"
  (res / "a").mkdir(parents=True)
  (res / "a" / "comparison.json").write_text(json.dumps(_claims(
      ["held", "not held", "inconclusive", "held", "held"],
      ["inconclusive", "not held", "inconclusive", "held", "not held"])))
  # A JSON beside a markdown wins; a markdown alone is read and flagged.
  (res / "a" / "comparison.md").write_text("## Verdicts\n\n| 1 | **not held** |\n")
  shutil.copytree(ROOT / "docs/results/study_default/seed0", res / "b")
  (res / "b" / "comparison.json").unlink(missing_ok=True)
  (res / "table.json").write_text(json.dumps([{"run": "A", "family": "grid", "dir": "a"},
                                                {"run": "B", "family": "sql", "dir": "b"}]))
  lines = results_table.render(tmp_path).splitlines()
  assert lines[0] == results_table.START and lines[-1] == results_table.END
  assert lines[3] == ("| [A](docs/results/a/comparison.md) | grid | held (vs a sharpened base: "
                      "inconclusive) | not held (vs a sharpened base: not held) | inconclusive (vs "
                      "a sharpened base: inconclusive) | held (vs a sharpened base: held) | held "
                      "(vs a sharpened base: not held) | comparison.json |")
  assert lines[4] == ("| [B](docs/results/b/comparison.md) | sql | not held | not held | inconclusive | "
                      f"not held | inconclusive | {results_table.MD_ONLY} |")
  readme = f"# x\n\nbefore\n{results_table.START}\nold\n{results_table.END}\nafter\n"
  out = results_table.replace_block(readme, "\n".join(lines))
  assert out == "# x\n\nbefore\n" + "\n".join(lines) + "\nafter\n"


def test_what_cannot_be_read_is_refused(tmp_path):
  res = tmp_path / "docs" / "results"
  (res / "gone").mkdir(parents=True)
  (res / "table.json").write_text(json.dumps([{"run": "G", "family": "grid", "dir": "gone"}]))
  with pytest.raises(FileNotFoundError, match="table.json"):
    results_table.render(tmp_path)
  (res / "table.json").write_text(json.dumps([{"run": "G", "dir": "gone"}]))
  with pytest.raises(ValueError, match="names no \"family\""):
    results_table.render(tmp_path)
  (res / "table.json").write_text(json.dumps([{"run": "G", "family": "grid", "dir": "gone"}]))
  (res / "gone" / "comparison.md").write_text("## Verdicts\n\n| 1 | **held** |\n")
  with pytest.raises(ValueError, match=r"lists claims \[1\], not 1-5"):
    results_table.render(tmp_path)
  with pytest.raises(ValueError, match="markers"):
    results_table.replace_block("no markers here", "x")
  with pytest.raises(ValueError, match="markers"):
    results_table.replace_block(f"{results_table.END}\n{results_table.START}", "x")
