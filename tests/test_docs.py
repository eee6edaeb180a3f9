"""The documentation as a product: short front pages, no run history, every committed result cited, every cited
result and every relative link present, every key of the "petra" config section documented.

Pure file reads: no torch.distributed, no model, fast.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from petra_ds.runtime.config import PetraConfig

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
BENCHMARKS = ROOT / "BENCHMARKS.md"
ARCHITECTURE = ROOT / "ARCHITECTURE.md"
DOCS = ROOT / "docs"
RESULTS = ROOT / "benchmarks" / "results"
MAX_LINES = 250

#: labels that date a text by when it was written or run instead of saying what is true now
HISTORY_LABELS = [
    re.compile(r"\b[Ss]essions? \d+"),                  # "session 14", "sessions 9-14"
    re.compile(r"\b(?:this|that|last|next|previous|earlier) session\b", re.IGNORECASE),
    re.compile(r"\b[Ii]ssue \d+"),                      # the project's own issue numbers as section labels
    re.compile(r"\((?:first|second|third) (?:run|part)\)", re.IGNORECASE),
    re.compile(r"\b20\d\d-\d\d-\d\d\b"),                # ISO dates
    re.compile(r"\b(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec)[a-z]* \d{1,2}, 20\d\d\b"),
]
#: a benchmarks/results path as the docs cite it (placeholders such as gpu_<device>.json do not match)
RESULT_PATH = re.compile(r"benchmarks/results/([\w.\-]+\.(?:json|png))")
#: [text](target) and ![alt](target), target without spaces
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def docs_pages() -> list[Path]:
    return sorted(DOCS.rglob("*.md")) if DOCS.is_dir() else []


def history_checked() -> list[Path]:
    return [p for p in (README, BENCHMARKS, ARCHITECTURE, *docs_pages()) if p.exists()]


def citing() -> list[Path]:
    """The texts that may cite a committed result."""
    return [BENCHMARKS, *docs_pages()]


def prose(path: Path) -> str:
    """The text outside fenced code blocks (a link inside a code block is an example, not a link)."""
    out, fenced = [], False
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            out.append(line)
    return "\n".join(out)


def anchors(path: Path) -> set[str]:
    """GitHub's heading anchors of a markdown file: lower case, punctuation but '-' and '_' dropped, spaces to '-'."""
    slugs = set()
    for line in prose(path).splitlines():
        match = re.match(r"#{1,6}\s+(.*)", line)
        if match:
            text = re.sub(r"[`*]", "", match.group(1).strip()).lower()
            slugs.add(re.sub(r"[^\w\- ]", "", text).replace(" ", "-"))
    return slugs


@pytest.mark.parametrize("path", [README, BENCHMARKS], ids=lambda p: p.name)
def test_front_pages_stay_short(path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.name} has {lines} lines; at most {MAX_LINES} (details go under docs/)"


def test_no_run_history_labels():
    found = []
    for path in history_checked():
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for label in HISTORY_LABELS:
                for match in label.finditer(line):
                    found.append(f"{path.relative_to(ROOT)}:{number}: {match.group(0)!r}")
    assert not found, "run-history labels (say what is true now; git keeps the history):\n" + "\n".join(found)


def test_every_committed_result_is_cited():
    text = "\n".join(p.read_text() for p in citing() if p.exists())
    files = sorted(p.name for p in RESULTS.iterdir() if p.is_file())
    uncited = [name for name in files if name not in text]
    assert not uncited, ("benchmarks/results/ files no doc cites (cite them in BENCHMARKS.md or docs/, or remove "
                         f"them): {uncited}")


def test_every_cited_result_exists():
    missing = []
    for path in citing():
        if path.exists():
            for name in RESULT_PATH.findall(path.read_text()):
                if not (RESULTS / name).is_file():
                    missing.append(f"{path.relative_to(ROOT)}: benchmarks/results/{name}")
    assert not missing, "cited results that do not exist:\n" + "\n".join(missing)


def test_every_petra_config_key_is_documented():
    reference = (DOCS / "reference" / "config.md").read_text()
    missing = [f.name for f in dataclasses.fields(PetraConfig) if f"`{f.name}`" not in reference]
    assert not missing, f'"petra" keys missing from docs/reference/config.md: {missing}'


def test_relative_links_resolve():
    broken = []
    for page in [README, BENCHMARKS, *docs_pages()]:
        for target in LINK.findall(prose(page)):
            if re.match(r"[a-z][a-z0-9+.\-]*:", target) or target.startswith("//"):
                continue  # http:, https:, mailto: ...
            file_part, _, fragment = target.partition("#")
            resolved = (page.parent / file_part).resolve() if file_part else page
            where = f"{page.relative_to(ROOT)}: ({target})"
            if not resolved.exists():
                broken.append(f"{where}: no such file")
            elif fragment and resolved.suffix == ".md" and fragment not in anchors(resolved):
                broken.append(f"{where}: no heading #{fragment} in {resolved.relative_to(ROOT)}")
    assert not broken, "broken relative links:\n" + "\n".join(broken)


def test_the_ci_finds_the_test_command():
    """.ci/run runs the first non-fence line after the marker; it must be the install and the test run."""
    lines = README.read_text().splitlines()
    assert "<!-- test-command -->" in lines, "README.md lost the <!-- test-command --> marker .ci/run looks for"
    after = lines[lines.index("<!-- test-command -->") + 1:][:2]
    command = next((line for line in after if not line.startswith("```") and "<!--" not in line), "")
    assert "pip install" in command and "pytest" in command, f"the CI's test command is {command!r}"


def test_every_documented_default_is_the_configs():
    """The reference table's default of each plain key is what ``PetraConfig()`` holds."""
    reference = (ROOT / "docs" / "reference" / "config.md").read_text()
    defaults = {}
    for line in reference.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and cells[0].startswith("`") and cells[1].startswith("`"):
            defaults[cells[0].strip("`")] = cells[1].strip("`")
    config = PetraConfig()
    plain = [f.name for f in dataclasses.fields(PetraConfig)
             if isinstance(getattr(config, f.name), (bool, int, float, str))]
    assert plain and all(name in defaults for name in plain), sorted(set(plain) - set(defaults))
    wrong = {name: (defaults[name], getattr(config, name)) for name in plain
             if json.loads(defaults[name]) != getattr(config, name)}
    assert wrong == {}
