"""Docs and code comments are reference, not a work log: no machine-local paths, no numbered work sessions, and
architecture.md's file table matches the modules under engine_core/."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CODE_DIRS = ("engine_core", "kernels", "services", "benchmarks", "tests")
GENERATED = (ROOT / "services" / "pb",)
# NOTE: a path of one machine (run folders, a home directory) or a reference to a numbered work session means
# nothing to a reader elsewhere; the fact it stood for belongs in the text, with its number.
MACHINE_PATH = re.compile(r"(?<![\w.~-])/(?:work|root|tmp)/")
WORK_SESSION = re.compile(r"\bsessions? \d+", re.IGNORECASE)
# How docs and comments cite a section: the file, a comma and the heading in double quotes (which may wrap), or a
# markdown link to the heading's anchor.
SECTION_REF = re.compile(r'(\w+)\.md,?\s+"([^"]+)"')
ANCHOR_REF = re.compile(r"\((\w+)\.md#([\w-]+)\)")
C_COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.DOTALL)
SHELL_COMMENT = re.compile(r"(?:^|\s)#[^\n]*")


def python_comments(source: str) -> list[str]:
    """The comments and docstrings of a Python source: what a reader takes as prose."""
    texts = [
        tok.string for tok in tokenize.generate_tokens(io.StringIO(source).readline) if tok.type == tokenize.COMMENT
    ]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                texts.append(doc)
    return texts


def comments_of(path: Path) -> list[str]:
    source = path.read_text(encoding="utf-8")
    if path.suffix == ".py":
        return python_comments(source)
    if path.suffix in (".cpp", ".h", ".proto"):
        return C_COMMENT.findall(source)
    return SHELL_COMMENT.findall(source)


def log_markers(text: str) -> list[str]:
    """Machine-local paths and work-session references in `text`."""
    return [m.group(0) for pattern in (MACHINE_PATH, WORK_SESSION) for m in pattern.finditer(text)]


def code_files() -> list[Path]:
    files = []
    for top in CODE_DIRS:
        for path in sorted((ROOT / top).rglob("*")):
            if path.suffix not in (".py", ".cpp", ".h", ".proto", ".sh") or "__pycache__" in path.parts:
                continue
            if any(path.is_relative_to(g) for g in GENERATED):
                continue
            files.append(path)
    return files


def test_the_scanner_finds_what_it_looks_for() -> None:
    source = '"""Module doc: from /work/runs/s9/loads.py."""\nx = "/work/ in a string is code"  # as Session 12 found\n'
    texts = python_comments(source)
    assert [m for t in texts for m in log_markers(t)] == ["Session 12", "/work/"]
    assert log_markers("int x;  // see /root/.cache") == ["/root/"]
    assert log_markers("sessions 1-3 ran on /tmp/run1") == ["/tmp/", "sessions 1"]
    assert log_markers("a test session, ~/tmp/x, a/work/b, 16 sessions") == []


@pytest.mark.parametrize("doc", [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"], ids=lambda p: p.name)
def test_docs_have_no_machine_paths_or_session_numbers(doc: Path) -> None:
    found = [
        f"{doc.name}:{n}: {marker}"
        for n, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1)
        for marker in log_markers(line)
    ]
    assert not found, found


def test_code_comments_have_no_machine_paths_or_session_numbers() -> None:
    found = [
        f"{path.relative_to(ROOT)}: {marker}"
        for path in code_files()
        for text in comments_of(path)
        for marker in log_markers(text)
    ]
    assert not found, found


def file_table_paths(markdown: str) -> list[str]:
    """The first cell of each row of architecture.md's "Files (engine_core)" table."""
    section = markdown.split("## Files (engine_core)", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `([^`]+)` \|", section, re.MULTILINE)


def test_architecture_file_table_lists_every_engine_core_module() -> None:
    listed = file_table_paths((ROOT / "docs" / "architecture.md").read_text(encoding="utf-8"))
    package = ROOT / "engine_core"
    modules = {
        str(p.relative_to(package))
        for p in package.rglob("*.py")
        if p.name != "__init__.py" and "__pycache__" not in p.parts
    }
    assert len(listed) == len(set(listed)), "a module is listed twice"
    assert sorted(set(listed) - modules) == [], "listed but not in engine_core/"
    assert sorted(modules - set(listed)) == [], "in engine_core/ but not listed"


def headings(doc: str) -> list[str]:
    return [
        line.lstrip("#").strip()
        for line in (ROOT / "docs" / f"{doc}.md").read_text().splitlines()
        if line.startswith("#")
    ]


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def cited_sections(text: str) -> list[tuple[str, str]]:
    refs = [(doc, " ".join(title.split())) for doc, title in SECTION_REF.findall(text)]
    return refs + [(doc, "#" + a) for doc, a in ANCHOR_REF.findall(text)]


def test_section_references_name_existing_sections() -> None:
    texts = [(p.name, p.read_text(encoding="utf-8")) for p in sorted((ROOT / "docs").glob("*.md"))]
    texts += [(str(p.relative_to(ROOT)), t) for p in code_files() for t in comments_of(p)]
    known = {p.stem for p in (ROOT / "docs").glob("*.md")}
    refs = [(where, doc, title) for where, text in texts for doc, title in cited_sections(text) if doc in known]
    assert len(refs) > 20, "the reference pattern no longer matches how the docs cite sections"
    broken = [
        f"{where}: {doc}.md {title}"
        for where, doc, title in refs
        if (
            title[1:] not in {anchor(h) for h in headings(doc)} if title.startswith("#") else title not in headings(doc)
        )
    ]
    assert not broken, broken
