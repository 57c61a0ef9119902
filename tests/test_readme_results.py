"""README.md's result tables are generated from the committed results
(``tools/readme_results.py``): every marked block equals what the report functions render
from the committed JSON / filters file, so the tables cannot drift from the data."""

import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _tool():
    spec = importlib.util.spec_from_file_location("readme_results", REPO / "tools" / "readme_results.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_readme_result_blocks_equal_the_committed_results():
    tool = _tool()
    text = (REPO / "README.md").read_text()
    blocks = [m["src"] + "#" + m["what"] for m in tool.BLOCK.finditer(text)]
    # the evaluation section's tables: main run, both segments, the windows of the shipped file
    assert {"bench/results/eval_smollm2.json#Streaming perplexity", "bench/results/eval_segments_a.json#segments",
            "bench/results/eval_segments_b.json#segments",
            "bench/results/smollm2_filters.safetensors#windows"} <= set(blocks)
    _, stale = tool.regenerate(text)
    assert stale == [], f"README blocks out of date with bench/results: {stale} (python tools/readme_results.py)"


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
