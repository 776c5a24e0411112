"""The docs hold together: a short front page, links that resolve, data files a page cites,
a bounded docs folder, and no page, comment or file that narrates the development history.

"Tracked" means what ``git ls-files`` lists. The list is read from the git index directly
(formats 2 to 4), so these tests start no process.
"""

from __future__ import annotations

import re
import struct
from pathlib import Path, PurePosixPath
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parent.parent

README_MAX_LINES = 150
DOCS_MAX_FILES = 120
DOCS_MAX_BYTES = 3_000_000
DATA_SUFFIXES = frozenset({".json", ".png", ".csv", ".py"})


def _git_dir() -> Path | None:
    dot_git = ROOT / ".git"
    if dot_git.is_dir():
        return dot_git
    if dot_git.is_file():  # a worktree or submodule: "gitdir: PATH"
        text = dot_git.read_text(encoding="utf-8").strip()
        if text.startswith("gitdir:"):
            path = Path(text.removeprefix("gitdir:").strip())
            return path if path.is_absolute() else (ROOT / path).resolve()
    return None


def read_index_paths(index: bytes) -> list[str]:
    """The paths of a git index file (``git ls-files``), formats 2, 3 and 4."""
    if index[:4] != b"DIRC":
        raise ValueError("not a git index")
    version, count = struct.unpack(">II", index[4:12])
    if version not in (2, 3, 4):
        raise ValueError(f"git index version {version} is not supported")
    paths: list[str] = []
    offset = 12
    previous = b""
    for _ in range(count):
        start = offset
        flags = struct.unpack(">H", index[offset + 60 : offset + 62])[0]
        offset += 62
        if version >= 3 and flags & 0x4000:  # extended flags
            offset += 2
        if version == 4:
            strip, shift = 0, 0
            while True:  # the offset-encoded number of bytes to drop from the previous path
                byte = index[offset]
                offset += 1
                strip = (strip << 7) | (byte & 0x7F) if shift else byte & 0x7F
                if not byte & 0x80:
                    break
                strip += 1
                shift += 7
            end = index.index(b"\0", offset)
            path = previous[: len(previous) - strip] + index[offset:end]
            offset = end + 1
        else:
            end = index.index(b"\0", offset)
            path = index[offset:end]
            offset = start + ((end - start + 8) // 8) * 8  # entries are NUL-padded to 8 bytes
        previous = path
        paths.append(path.decode("utf-8", "surrogateescape"))
    return sorted(set(paths))  # a conflicted path has several stages


@pytest.fixture(scope="module")
def tracked() -> list[str]:
    git_dir = _git_dir()
    if git_dir is None or not (git_dir / "index").is_file():
        pytest.skip("not a git checkout: the tracked files are unknown")
    return read_index_paths((git_dir / "index").read_bytes())


def _text(path: str) -> str | None:
    """A tracked file's text, or None for a binary or missing one."""
    try:
        data = (ROOT / path).read_bytes()
    except (FileNotFoundError, IsADirectoryError):
        return None  # deleted in the work tree, or a submodule
    if b"\0" in data[:8192]:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


_FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
_CODE_SPAN = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"!?\[[^\]\n]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")
_DATA_MENTION = re.compile(r"[A-Za-z0-9_./-]+\.(?:json|png|csv|py)\b")


def markdown_links(text: str) -> list[str]:
    """Relative link targets of a page (outside code), without their anchors."""
    prose = _CODE_SPAN.sub("", _FENCE.sub("", text))
    targets = []
    for target in _LINK.findall(prose):
        if _SCHEME.match(target) or target.startswith("#"):
            continue
        target = unquote(target.split("#", 1)[0].split("?", 1)[0])
        if target:
            targets.append(target)
    return targets


def _resolve(page: str, target: str) -> str | None:
    base = PurePosixPath() if target.startswith("/") else PurePosixPath(page).parent
    parts: list[str] = []
    for part in (base / target.lstrip("/")).parts:
        if part == "..":
            if not parts:
                return None  # outside the repository
            parts.pop()
        elif part != ".":
            parts.append(part)
    return "/".join(parts)


def test_readme_is_short() -> None:
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines (at most {README_MAX_LINES})"


def test_every_relative_link_resolves_to_a_tracked_file(tracked: list[str]) -> None:
    files = set(tracked)
    folders = {str(PurePosixPath(path).parent) for path in tracked} | {
        "/".join(path.split("/")[:depth]) for path in tracked for depth in range(1, path.count("/") + 1)
    }
    pages = [p for p in tracked if p == "README.md" or (p.startswith("docs/") and p.endswith(".md"))]
    assert "README.md" in pages
    broken = []
    for page in pages:
        text = _text(page)
        if text is None:
            broken.append(f"{page}: tracked but missing from the work tree")
            continue
        for target in markdown_links(text):
            resolved = _resolve(page, target)
            if resolved is None or (resolved not in files and resolved.rstrip("/") not in folders):
                broken.append(f"{page}: ({target})")
    assert not broken, "links to no tracked file:\n" + "\n".join(broken)


def test_every_data_file_under_docs_is_cited_by_a_page(tracked: list[str]) -> None:
    cited: set[str] = set()
    for page in (p for p in tracked if p.endswith(".md")):
        text = _text(page)
        if text is None:
            continue
        mentions = markdown_links(text) + _DATA_MENTION.findall(text)
        for mention in mentions:
            for base in (page, "README.md"):  # relative to the page, or to the repository root
                resolved = _resolve(base, mention)
                if resolved is not None:
                    cited.add(resolved)
    data = [p for p in tracked if p.startswith("docs/") and PurePosixPath(p).suffix in DATA_SUFFIXES]
    uncited = [p for p in data if p not in cited]
    assert not uncited, f"{len(uncited)} data files under docs/ that no page cites:\n" + "\n".join(uncited)


def test_docs_folder_is_bounded(tracked: list[str]) -> None:
    docs = [p for p in tracked if p.startswith("docs/")]
    size = sum((ROOT / p).stat().st_size for p in docs if (ROOT / p).is_file())
    assert len(docs) <= DOCS_MAX_FILES, f"docs/ holds {len(docs)} tracked files (at most {DOCS_MAX_FILES})"
    assert size <= DOCS_MAX_BYTES, f"docs/ holds {size:,} bytes (at most {DOCS_MAX_BYTES:,})"


def _figure_rows(text: str) -> dict[str, tuple[str, str]]:
    """benchmark command -> (figure, date) of a page's table of current figures."""
    rows = {}
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        command = re.search(r"`(shoal [a-z -]+)`", cells[0]) if line.startswith("|") else None
        if command and len(cells) == 4 and re.fullmatch(r"\d{4}-\d{2}-\d{2}", cells[2]):
            rows[command.group(1)] = (cells[1], cells[2])
    return rows


def test_the_readme_quotes_the_figures_of_the_benchmarks_page() -> None:
    readme = _figure_rows((ROOT / "README.md").read_text(encoding="utf-8"))
    page = _figure_rows((ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8"))
    assert readme, "README.md has no table of current figures (benchmark | figure | date | result)"
    differ = [
        f"{name}: README {readme[name]} / benchmarks.md {page.get(name)}"
        for name in readme
        if readme[name] != page.get(name)
    ]
    assert not differ, "figures quoted with two values:\n" + "\n".join(differ)


# Built from pieces so that this file's own source does not match them.
_S = "sess" + "ion"
_ISSUE = "is" + "sue"
DIARY_PATTERNS = [
    re.compile(p, re.IGNORECASE)
    for p in (
        r"\b(?!with\b|both\b)[a-z]+th " + _S,  # "the fifth ...", not "async with ..."
        r"\bnext " + _S,
        r"\bearlier " + _S,
        r"\bthis " + _S,
        r"\b" + _ISSUE + r" [0-9]{1,2}\b",
        r"\bround [0-9]+\b",
        _ISSUE + r"[0-9]",
    )
]


def diary_matches(text: str) -> list[tuple[int, str]]:
    """(line number, matched text) of every development-diary phrase in ``text``."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for pattern in DIARY_PATTERNS:
            match = pattern.search(line)
            if match:
                found.append((number, match.group(0)))
    return found


def test_the_diary_patterns_catch_what_they_name() -> None:
    phrases = [
        "as the fif" + "th " + _S + " measured",
        "left for the ne" + "xt " + _S,
        "an earl" + "ier " + _S + "'s run",
        "in th" + "is " + _S,
        "see " + _ISSUE + " 20",
        "round" + " 3 of the sweep",
        "docs/bench/" + _ISSUE + "20_quiet.py",
    ]
    assert all(diary_matches(phrase) for phrase in phrases)
    assert not diary_matches("async with " + _S + ": rounds 3 and 4; an upstream bug, owner/repo#20")


def test_no_tracked_file_narrates_the_development_history(tracked: list[str]) -> None:
    found: list[str] = []
    for path in tracked:
        text = _text(path)
        if text is None:
            continue
        found.extend(f"{path}:{line}: {match}" for line, match in diary_matches(text))
    assert not found, f"{len(found)} development-diary phrases in tracked files:\n" + "\n".join(found)
