"""The documentation stands alone: every file that the docs, the Python package, the examples and the
scripts point to exists in the repository, the README's Python snippets are valid Python, and every
megamoe name they use exists."""

import ast
import importlib
import pathlib
import re
import subprocess
import warnings

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
TOP_DIRS = ("include", "src", "python", "docs", "scripts", "examples", "tools", "tests", "benchmarks", ".ci")
# In the docs: a path starting with a top-level directory of the repository.
# (A pattern such as benchmarks/bench_*.py is not a path.)
PATH_TOKEN = re.compile(r"(?<![\w./$-])((?:%s)/[\w./-]*\w)(?![\w*{])" % "|".join(re.escape(d) for d in TOP_DIRS))
# Anywhere: a Markdown file by name (docs/LAYER.md, README.md, ...).
MD_TOKEN = re.compile(r"(?<![\w./$-])((?:[\w.-]+/)*[\w-]+\.md)\b")
# What a reader or user of the project reads: the docs, the Python package, its tests and examples, the
# scripts and the build settings.
CHECKED_SUFFIXES = (".md", ".py", ".sh", ".toml")
# A program is named after its source file (benchmarks/bench_gemm is built from benchmarks/bench_gemm.cu).
SOURCE_SUFFIXES = ("", ".cu", ".cpp", ".py")


def tracked_files():
    """The repository's files: tracked ones and those git would track (not ignored). A copy of the working
    tree whose git index is older than its files (a machine the tree was copied to) still counts them."""
    try:
        out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                             capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return out.split()


def references(rel, text):
    """(candidate paths, token) for every file reference in the text of the tracked file rel."""
    here = (REPO / rel).parent
    if rel.endswith(".md"):
        for m in re.finditer(r"\]\(([^)#\s]+)[^)]*\)", text):  # Markdown links
            if not re.match(r"[a-z]+:", m.group(1)):
                yield [here / m.group(1)], m.group(1)
        for m in PATH_TOKEN.finditer(text):
            token = m.group(1).rstrip(".")
            yield [REPO / (token + suffix) for suffix in SOURCE_SUFFIXES], token
    for m in MD_TOKEN.finditer(text):
        token = m.group(1)
        yield [here / token, REPO / token, REPO / "docs" / token], token


def test_every_file_the_project_mentions_exists():
    """A reference to a file that exists nowhere in the repository fails; one whose file exists under another
    directory (it moved) is reported as a warning, with where it lives now."""
    files = tracked_files()
    known = {(REPO / f).resolve() for f in files}
    known |= {p for f in list(known) for p in f.parents}
    by_name = {}
    for f in files:
        by_name.setdefault(pathlib.PurePosixPath(f).name, []).append(f)
    missing, moved = [], []
    for rel in files:
        if not rel.endswith(CHECKED_SUFFIXES) and rel != ".ci/run":
            continue
        for candidates, token in references(rel, (REPO / rel).read_text(errors="replace")):
            if any(c.resolve() in known for c in candidates):
                continue
            elsewhere = by_name.get(pathlib.PurePosixPath(token).name)
            if elsewhere and "/" in token:
                moved.append(f"{rel}: {token} (now {', '.join(elsewhere)})")
            else:
                missing.append(f"{rel}: {token}")
    if moved:
        warnings.warn("references to files that moved:\n" + "\n".join(moved))
    assert not missing, "references to files that are not in the repository:\n" + "\n".join(missing)


def test_readme_snippets_parse_and_their_megamoe_names_exist():
    readme = (REPO / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, re.S)
    assert len(blocks) >= 3, "the README lost its Python examples"
    names = set()
    for block in blocks:
        ast.parse(block)
        names.update(re.findall(r"\bmegamoe(?:\.\w+)+", block))
    names.update(re.findall(r"`(megamoe(?:\.\w+)+)", readme))
    assert "megamoe.synchronize_and_check" in names and "megamoe.MegaMoE" in names
    for name in sorted(names):
        parts = name.split(".")
        obj, i = None, len(parts)
        while i > 0:  # the longest importable module prefix, then attributes
            try:
                obj = importlib.import_module(".".join(parts[:i]))
                break
            except ImportError:
                i -= 1
        for attr in parts[i:]:
            assert hasattr(obj, attr), f"README names {name}, but {'.'.join(parts[:i])} has no {attr}"
            obj = getattr(obj, attr)
