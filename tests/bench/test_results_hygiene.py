"""The published benchmark results and the docs that point at them stay curated: one folder
per topic with a README, data rather than raw logs, no machine paths, links that resolve;
and the README's quickstart stays two commands."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results"
# What a results folder holds: data, the published plots, the README.
DATA_SUFFIXES = {".json", ".csv", ".md", ".png", ".txt"}
# Home, scratch and checkout directories of the machines the runs came from.
MACHINE_PATHS = re.compile(r"/(root|home|tmp|work|opt|Users)/")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def _result_folders() -> list[Path]:
    return sorted(p for p in RESULTS.iterdir() if p.is_dir())


def test_every_results_folder_has_a_readme_and_data_only() -> None:
    folders = _result_folders()
    assert folders, "benchmarks/results has no folders"
    for folder in folders:
        assert (folder / "README.md").is_file(), folder.name
        # Named after the topic and the machine, not after a round of work.
        assert re.fullmatch(r"[a-z0-9-]+-(\d+x)?h[12]00", folder.name), folder.name
        files = [p for p in folder.rglob("*") if p.is_file()]
        assert any(p.suffix in (".json", ".csv") for p in files), f"{folder.name} has no data"
        for path in files:
            assert path.suffix in DATA_SUFFIXES, f"{path.relative_to(RESULTS)} is not data (a raw log?)"
    listed = set(re.findall(r"\[`([a-z0-9-]+)/`\]", (RESULTS / "README.md").read_text()))
    assert listed == {f.name for f in folders}, "benchmarks/results/README.md must list every folder"


def test_results_carry_no_machine_paths() -> None:
    for path in RESULTS.rglob("*"):
        if path.is_file() and path.suffix != ".png":
            match = MACHINE_PATHS.search(path.read_text())
            assert match is None, f"{path.relative_to(RESULTS)}: {match.group(0)}"


def test_results_json_parses_and_names_its_command() -> None:
    for path in RESULTS.rglob("*.json"):
        payload = json.loads(path.read_text())
        if payload.get("schema", "").startswith("flce-bench"):
            assert "OUTDIR" in payload["command"] or "--out" not in payload["command"], path.name


@pytest.mark.parametrize(
    "doc",
    [
        "README.md",
        "docs/performance.md",
        "docs/parallel.md",
        "benchmarks/README.md",
        *(str(p.relative_to(REPO)) for p in sorted(RESULTS.rglob("README.md"))),
    ],
)
def test_relative_links_resolve(doc: str) -> None:
    path = REPO / doc
    for target in LINK.findall(path.read_text()):
        if "://" in target:
            continue
        assert (path.parent / target).exists(), f"{doc}: broken link {target}"


def test_readme_quickstart_is_two_commands_and_says_how_to_install_without_a_gpu() -> None:
    readme = (REPO / "README.md").read_text()
    quickstart = readme.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    first_block = quickstart.split("```bash", 1)[1].split("```", 1)[0]
    commands = [line for line in first_block.splitlines() if line.strip()]
    assert len(commands) == 2, commands
    assert "flce bench" in commands[0] and "pytest" in commands[1]
    # A plain install pulls the CUDA build of torch: the CPU wheels' index is named.
    assert "https://download.pytorch.org/whl/cpu" in quickstart and "CUDA build" in quickstart
    # The examples, which need transformers, say how to get it.
    assert "`examples/`" in quickstart and '".[hf]"' in quickstart
