"""The docs hold: no tracked file names a work session, every relative link and file path that
README.md and docs/*.md cite resolves, and every `samebits <subcommand> --flag` the README cites
is in that subcommand's `--help` (the parser built in-process). Each check has a control: the
same function run on a planted example that must fail."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from samebits import cli

REPO = Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

# --- no file names a work session ------------------------------------------------------------

_ORDINALS = (
    "first second third fourth fifth sixth seventh eighth ninth tenth eleventh twelfth thirteenth "
    "fourteenth fifteenth sixteenth seventeenth eighteenth nineteenth twentieth"
).split()
_ORDINAL = "(?:twenty-|thirty-)?(?:" + "|".join(_ORDINALS) + ")|twenty|thirty|\\d+(?:st|nd|rd|th)"
SESSION = re.compile(
    r"\b(?:" + _ORDINAL + r")[ -]session"  # an ordinal, spelled or numbered
    r"|\bsession \d"  # a session by number
    r"|\b(?:this|that|last|previous|next|earlier|later) (?:work |device )?session\b"
    r"|-s\d+(?=[-.]|$)",  # a session ordinal in a file name, as in "-s" + "13.json"
    re.IGNORECASE | re.MULTILINE,
)


def session_mentions(text: str) -> list[str]:
    """The phrases of `text` that name a work session (pytest's `scope="session"` does not)."""
    return [m.group(0) for m in SESSION.finditer(text)]


def tracked_files() -> list[Path]:
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True, timeout=60
        ).stdout
    except (OSError, subprocess.SubprocessError):
        pytest.skip("not a git checkout")
    return [REPO / name for name in out.decode().split("\0") if name]


def test_no_tracked_file_names_a_session():
    found = []
    for path in tracked_files():
        if not path.is_file():  # deleted in the work tree, not yet committed
            continue
        rel = str(path.relative_to(REPO))
        text = path.read_bytes().decode("utf-8", errors="replace")
        found += [f"{rel}: {hit}" for hit in session_mentions(rel + "\n" + text)]
    assert not found, "name a date, a commit or a results file instead:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "planted",
    [
        "measured in the " + "thirteenth" + " session",
        "(docs/perf-notes.md, " + "Twenty-first" + " session)",
        "as the " + "19th" + " session found",
        "run in " + "session " + "4",
        "measured " + "this" + " session",
        "benchmarks/results/bench-h200-2026-12-04" + "-s13" + ".json",
        "rl-update-phases-h200-2026-12-05" + "-s18" + "-new.json",
    ],
)
def test_the_session_check_catches_a_planted_phrase(planted):
    assert session_mentions("some text, " + planted + ", more text")


def test_the_session_check_leaves_pytest_scopes_and_flags_alone():
    assert not session_mentions('@pytest.fixture(scope="session")\nonce per session\npytest -s -x')


# --- every relative link and cited file path resolves ----------------------------------------

_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_CODE = re.compile(r"`([^`\n]+)`")
_PATH = re.compile(r"^(?:\.\./|\./)?(?:[\w.-]+/)*[\w.-]+\.(?:py|md|sh|txt|toml|json|cfg|yml|yaml)$")
# Where a bare path is looked for: the doc's own folder, the repository, the package.
_BASES = (Path("."), Path("src"), Path("src/samebits"))
# Files a command writes or a user brings, cited as such, not files of this repository.
_NOT_OURS = re.compile(
    r"(?:^|/)(?:bench|metrics|profile|probe|sync|rl_step|out|results|config|model\.safetensors"
    r"|tokenizer|tokenizer_config|generation_config|preprocessor_config|chat_template"
    r"|pyproject)\.(?:json|jsonl|csv|png|toml)$"
    r"|^model\.safetensors\.index\.json$"
    r"|^(?:trl|verl|transformers|torch|triton|vllm|sglang|slime|areal)/"  # other projects' files
    r"|^(?:runs|/|~|old/|\.venv/)|\*|<|\{"
)


def cited_paths(text: str) -> list[str]:
    """Relative link targets, and backticked spans that are one file path, of a Markdown text."""
    out = []
    for target in _LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL or an anchor on the same page
        out.append(target.split("#", 1)[0])
    for span in _CODE.findall(text):
        span = span.strip()
        path = re.split(r"::|:\d|\s", span, maxsplit=1)[0]  # file.py::test, file.py:12, file.py --flag
        if _PATH.match(path) and not _NOT_OURS.search(path) and (" " not in span or path.endswith(".py")):
            out.append(path)
    return [p for p in out if p]


def _repo_files() -> list[str]:
    skip = {".git", ".venv", "__pycache__", ".pytest_cache", ".ruff_cache", "runs"}
    return [
        str(p.relative_to(REPO))
        for p in REPO.rglob("*")
        if p.is_file() and not skip.intersection(p.relative_to(REPO).parts)
    ]


def unresolved(doc: Path, text: str, files: list[str] | None = None) -> list[str]:
    """The cited paths of `text` (a doc at `doc`) that name no file or folder: a path with a
    folder is looked for from the doc's folder, the repository, `src/` and the package and its
    subpackages (`kernels/pdl.py`); a bare file name (`scheduler.py`) anywhere in the repository."""
    files = _repo_files() if files is None else files
    names = {Path(f).name for f in files}
    packages = [Path("src/samebits") / p.name for p in (REPO / "src/samebits").iterdir() if p.is_dir()]
    missing = []
    for cited in cited_paths(text):
        if "/" not in cited.rstrip("/"):
            if cited in names or (doc.parent / cited).exists():
                continue
        elif any((base / cited).exists() for base in [doc.parent, *(REPO / b for b in (*_BASES, *packages))]):
            continue
        missing.append(cited)
    return missing


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_cited_path_resolves(doc):
    assert not unresolved(doc, doc.read_text()), f"{doc.name} cites paths that do not exist"


def test_the_path_check_catches_a_planted_broken_link():
    text = "see [the notes](docs/no-such-page.md), `src/samebits/kernels/no_such_kernel.py`, `design.md`"
    files = ["docs/design.md", "src/samebits/kernels/pdl.py"]
    assert unresolved(REPO / "README.md", text, files) == [
        "docs/no-such-page.md",
        "src/samebits/kernels/no_such_kernel.py",
    ]
    assert unresolved(REPO / "README.md", "`no_such_file.py`, `kernels/pdl.py`", files) == ["no_such_file.py"]


def test_the_path_check_sees_links_and_paths():
    text = "[a](docs/design.md#layers) [b](https://example.com/x.md) `kernels/pdl.py` `tests/test_docs.py::x`"
    assert cited_paths(text) == ["docs/design.md", "kernels/pdl.py", "tests/test_docs.py"]


# --- every `samebits <subcommand> --flag` the README cites is in its --help ---------------------

_INVOCATION = re.compile(r"\bsamebits(?:\.cli)?((?:[ \t]+(?!#)[^\s|;&#`]+)*)")


def _code_text(markdown: str) -> list[str]:
    """The command lines of a Markdown text: fenced blocks' lines and inline code spans, with
    backslash continuations joined."""
    fenced = re.findall(r"^```[^\n]*\n(.*?)^```", markdown, re.DOTALL | re.MULTILINE)
    rest = re.sub(r"^```[^\n]*\n.*?^```", "", markdown, flags=re.DOTALL | re.MULTILINE)
    lines = [line for block in fenced for line in block.replace("\\\n", " ").splitlines()]
    return lines + [span.replace("\n", " ") for span in re.findall(r"`([^`]+)`", rest)]


def cited_flags(markdown: str) -> list[tuple[str | None, str]]:
    """(subcommand or None for the top level, --flag) for each flag cited after `samebits`."""
    out = []
    for line in _code_text(markdown):
        for m in _INVOCATION.finditer(line):
            words = m.group(1).split()
            sub = words[0] if words and not words[0].startswith("-") else None
            out += [(sub, w.split("=", 1)[0]) for w in words if re.match(r"^--[a-z]", w)]
    return out


def _helps() -> dict[str | None, str]:
    parser = cli.build_parser()
    (subs,) = (a for a in parser._actions if a.dest == "command")
    helps = {name: p.format_help() for name, p in subs.choices.items()}
    helps[None] = parser.format_help()
    return helps


def unknown_flags(markdown: str, helps: dict[str | None, str]) -> list[str]:
    bad = []
    for sub, flag in cited_flags(markdown):
        if sub not in helps:
            bad.append(f"samebits {sub} (no such subcommand)")
        elif not re.search(re.escape(flag) + r"(?![\w-])", helps[sub]):
            bad.append(f"samebits {sub or ''} {flag}")
    return bad


def test_every_readme_flag_is_in_its_subcommands_help():
    text = (REPO / "README.md").read_text()
    assert cited_flags(text), "the README cites no samebits command: the check would pass vacuously"
    assert not unknown_flags(text, _helps())


def test_the_flag_check_catches_a_planted_flag():
    helps = _helps()
    text = "```bash\nsamebits rl --steps 3 --no-such-flag\n```\nthen `samebits serve --port 1 --ports 2`"
    cited = [("rl", "--steps"), ("rl", "--no-such-flag"), ("serve", "--port"), ("serve", "--ports")]
    assert cited_flags(text) == cited
    assert unknown_flags(text, helps) == ["samebits rl --no-such-flag", "samebits serve --ports"]
    assert unknown_flags("`samebits nosuch --x`", helps) == ["samebits nosuch (no such subcommand)"]
