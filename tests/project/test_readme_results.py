"""The result tables of README.md and docs/*.md are generated from the committed results
(``tools/readme_results.py``): every marked block equals what the report functions render
from the committed JSON / Markdown / filters file, so the tables cannot drift from the data."""

import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _tool():
    spec = importlib.util.spec_from_file_location("readme_results", REPO / "tools" / "readme_results.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_result_blocks_equal_the_committed_results():
    tool = _tool()
    blocks, stale = set(), []
    for path in tool.documents():
        text = path.read_text()
        blocks |= {m["src"] + "#" + m["what"] for m in tool.BLOCK.finditer(text)}
        stale += [f"{path.name}: {s}" for s in tool.regenerate(text)[1]]
    # the front page's trade-off, the evaluation's tables (main run, both segments, the windows
    # of the shipped file), and benchmark tables copied from their results files
    assert {"bench/results/eval_smollm2.json#tradeoff", "bench/results/eval_smollm2.json#Streaming perplexity",
            "bench/results/eval_segments_a.json#segments", "bench/results/eval_segments_b.json#segments",
            "bench/results/smollm2_filters.safetensors#windows", "bench/results/server.md#table"} <= blocks
    assert stale == [], f"blocks out of date with bench/results: {stale} (python tools/readme_results.py)"
    readme = (REPO / "README.md").read_text()
    assert "<!-- results: bench/results/eval_smollm2.json#tradeoff -->" in readme


def test_a_stale_block_is_rewritten_and_named():
    tool = _tool()
    src = "bench/results/eval_smollm2.json#Streaming perplexity"
    text = f"intro\n<!-- results: {src} -->\n| stale |\n<!-- /results -->\nafter\n"
    new, stale = tool.regenerate(text)
    assert stale == [src]
    body = new.split("-->\n", 1)[1].split("<!-- /results -->")[0]
    assert body == tool.render("bench/results/eval_smollm2.json", "Streaming perplexity")
    assert "| streaming_llm | 18.53 (+7.06) |" in body and new.endswith("<!-- /results -->\nafter\n")
    assert tool.regenerate(new)[1] == []
    with pytest.raises(ValueError, match="no section starting with 'Nope'"):
        tool.render("bench/results/eval_smollm2.json", "Nope")


def test_tradeoff_table_against_the_json():
    tool = _tool()
    results = json.loads((REPO / "bench/results/eval_smollm2.json").read_text())
    rows = tool.render("bench/results/eval_smollm2.json", "tradeoff").splitlines()
    s = results["settings"]
    total = s["ppl_prefix"] + s["ppl_scored"]
    assert rows[0] == "| | full cache | " + " | ".join(f"budget {b}" for b in s["budgets"]) + " |"
    cells = [[c.strip() for c in r.strip("|").split("|")] for r in rows[2:]]
    assert [float(c.rstrip("%")) for c in cells[0][2:]] == [round(100 * b / total, 1) for b in s["budgets"]]
    for cell, arm in zip(cells[1:], ("streaming_llm@{}", "qfilters-calibrated@r1/2@{}")):
        assert float(cell[1]) == round(results["perplexity"]["full"]["ppl"], 2)
        assert [float(c) for c in cell[2:]] == [round(results["perplexity"][arm.format(b)]["ppl"], 2) for b in s["budgets"]]


def test_markdown_table_blocks_copy_the_nth_table(tmp_path):
    tool = _tool()
    md = tmp_path / "r.md"
    md.write_text("# title\n\n| a |\n|---|\n| 1 |\ntext\n\n| b |\n|---|\n| 2 |\n")
    assert tool.markdown_table(md, "table") == "| a |\n|---|\n| 1 |\n"
    assert tool.markdown_table(md, "table 2") == "| b |\n|---|\n| 2 |\n"
    with pytest.raises(ValueError, match="has 2 table"):
        tool.markdown_table(md, "table 3")
