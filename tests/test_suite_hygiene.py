"""The test suite and the docs themselves.

A module-level test defined twice under one name silently replaces the first (pytest collects only
the last), so its cases stop running without any failure; that happened once (a new CUDA-graph
test shadowed an older one). An unclosed code fence turns the rest of a Markdown file into one
code block; that happened to the README. Both are caught here, in CI, as are the phase-clock
tools' edits that no longer find their lines in the kernels."""

import ast
import collections
import pathlib
import re
import subprocess
import sys

import pytest

TESTS = pathlib.Path(__file__).resolve().parent


def names_defined_twice(source):
    """Module-level functions and classes of `source` defined more than once."""
    counts = collections.Counter(
        node.name for node in ast.parse(source).body
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)))
    return sorted(name for name, count in counts.items() if count > 1)


def test_no_module_level_name_is_defined_twice():
    clashes = [f"{path.name}: {name}" for path in sorted(TESTS.glob("*.py"))
               for name in names_defined_twice(path.read_text())]
    assert not clashes, "defined twice (the first is never run): " + ", ".join(clashes)


def test_a_clash_is_found():
    source = "import pytest\n\n\ndef test_a():\n    pass\n\n\nclass B:\n    pass\n\n\ndef test_a(x):\n    pass\n"
    assert names_defined_twice(source) == ["test_a"]
    assert names_defined_twice(source.replace("test_a(x)", "test_c(x)")) == []


# -- the user docs -------------------------------------------------------------------------------

ROOT = TESTS.parent
DOCS = [ROOT / "README.md", ROOT / "tools" / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
# A results diary cites its entries by ordinal ("the twentieth run"); the docs keep current
# numbers with their dates, and the history stays in git.
DIARY_CITATION = re.compile(
    r"\b(first|second|third|[a-z]+th|twenty[- ][a-z]+|[0-9]+(st|nd|rd|th)) (gpu |cpu )?run\b", re.I)


def unclosed_fence(text):
    """The line number of a code fence that is never closed (it would swallow the rest of the
    document into one code block), or None. Fences follow CommonMark: ``` or ~~~, closed by a
    fence of the same character at least as long."""
    opened = None
    for number, line in enumerate(text.splitlines(), 1):
        m = re.match(r"^ {0,3}(`{3,}|~{3,})", line)
        if not m:
            continue
        fence = m.group(1)
        if opened is None:
            opened = (number, fence)
        elif fence[0] == opened[1][0] and len(fence) >= len(opened[1]) and not line.strip()[len(fence):].strip():
            opened = None
    return opened[0] if opened else None


def test_docs_code_fences_are_closed():
    unclosed = [f"{path.relative_to(ROOT)}:{unclosed_fence(path.read_text())}" for path in DOCS
                if unclosed_fence(path.read_text())]
    assert not unclosed, "code fence opened and never closed: " + ", ".join(unclosed)


def test_an_unclosed_fence_is_found():
    assert unclosed_fence("# a\n```bash\nx\n```\ntext\n") is None
    assert unclosed_fence("# a\n```bash\nx\n```\n## b\n```\n") == 6
    assert unclosed_fence("````\n```\n````\n") is None


def test_docs_cite_no_run_diary():
    hits = [f"{path.relative_to(ROOT)}:{number}: {line.strip()}" for path in DOCS
            for number, line in enumerate(path.read_text().splitlines(), 1) if DIARY_CITATION.search(line)]
    assert not hits, "cite a docs/design.md section or a date instead:\n" + "\n".join(hits)
    assert DIARY_CITATION.search("as the twenty-fifth run showed") and DIARY_CITATION.search("CPU tenth run")


def test_tools_readme_lists_every_tool():
    tools = ROOT / "tools"
    listed = (tools / "README.md").read_text()
    missing = [p.name for p in sorted(tools.iterdir())
               if p.suffix in (".py", ".sh", ".c", ".cu") and f"`{p.name}`" not in listed]
    assert not missing, "tools/README.md has no line for: " + ", ".join(missing)


# The phase-clock tools edit the kernel sources at fixed lines: when a kernel moves, their `patch`
# stops at the line it cannot find, and nothing else runs it (team_phase_clocks.py had stopped
# matching the team kernels unnoticed).
PHASE_CLOCK_TOOLS = ["team_phase_clocks.py", "sweep_phase_clocks.py", "cols_phase_clocks.py"]


@pytest.mark.parametrize("tool", PHASE_CLOCK_TOOLS)
def test_phase_clock_tools_still_patch_the_kernels(tool, tmp_path):
    if not (ROOT / ".git").exists():
        pytest.skip("the tools copy a git checkout's tracked files")
    done = subprocess.run([sys.executable, str(ROOT / "tools" / tool), "patch", str(tmp_path / "copy")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_moved_anchor_stops_the_patch(tmp_path):
    if not (ROOT / ".git").exists():
        pytest.skip("the tools copy a git checkout's tracked files")
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        from team_phase_clocks import instrumented_copy
    finally:
        sys.path.remove(str(ROOT / "tools"))
    with pytest.raises(SystemExit):
        instrumented_copy(str(tmp_path / "copy"), "README.md", [("a line no file has", "")])


CITATION = re.compile(r"docs/design\.md[,;:]? *(?:section )?['\"]([^'\"]+)['\"]")


def design_citations(text):
    """The section names a text cites as docs/design.md, 'Section' (a name may wrap onto the next
    comment line)."""
    return {re.sub(r"\s*\n\s*(?://|#|\*)?\s*", " ", name) for name in CITATION.findall(text)}


def markdown_headings(text):
    """The headings of a markdown text, without their #s."""
    return [m.group(1).strip() for m in re.finditer(r"^#+ (.+)$", text, re.M)]


def test_design_citations_name_existing_sections():
    headings = set(markdown_headings((ROOT / "docs" / "design.md").read_text()))
    missing = {}
    for folder in ("csrc", "ops", "tests", "tools", "benchmarks", "scripts"):
        for path in (ROOT / folder).rglob("*"):
            if path.suffix in (".py", ".h", ".cpp", ".cu", ".cuh", ".sh") and path.is_file() and path.name != "test_suite_hygiene.py":
                for name in design_citations(path.read_text(errors="replace")) - headings:
                    missing.setdefault(name, []).append(str(path.relative_to(ROOT)))
    assert not missing, f"docs/design.md has no section of these names: {missing}"


def test_a_missing_design_section_is_found():
    assert design_citations("x  // docs/design.md, 'Team path'") == {"Team path"}
    assert design_citations('see docs/design.md "Numerics"') == {"Numerics"}
    assert design_citations("// docs/design.md, 'Kernel\n  // overrides'") == {"Kernel overrides"}


# design.md cites the measurement log that docs/performance.md kept until 2026-12-05 as
# (perf log, "Section"); the log itself is in git, at the commit design.md's introduction names.
PERF_LOG_CITATION = re.compile(r"perf log,?\s+\"([^\"]+)\"")


def perf_log_citations(text):
    """The section names a text cites as (perf log, "Section"), a name's line breaks as spaces."""
    return {re.sub(r"\s+", " ", name) for name in PERF_LOG_CITATION.findall(text)} - {"Section"}


def test_perf_log_citations_name_sections_of_the_log():
    design = (ROOT / "docs" / "design.md").read_text()
    commit = re.search(r"git show ([0-9a-f]{7,40}):docs/performance\.md", design)
    assert commit, "design.md's introduction names the commit of the measurement log"
    if not (ROOT / ".git").exists():
        pytest.skip("the log is read from git")
    log = subprocess.run(["git", "show", f"{commit.group(1)}:docs/performance.md"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    if log.returncode != 0:
        pytest.skip(f"no commit {commit.group(1)} in this clone (a shallow one?)")
    headings = markdown_headings(log.stdout)
    missing = sorted(name for name in perf_log_citations(design) if not any(h.startswith(name) for h in headings))
    assert not missing, f"the perf log has no section of these names: {missing}"


def test_a_perf_log_citation_is_read():
    assert perf_log_citations('(perf log, "Team\n  count"); perf log "Sweep path"') == {"Team count", "Sweep path"}
